"""Cancel a replica call whose client went away while Serve's proxy was
writing to it.

Ray Serve 2.60's proxy cancels the replica call behind a stream only when the
client's cancellation lands while the proxy awaits the replica's next message
(``ProxyResponseGenerator.__anext__``). A gRPC client that cancels while the
proxy is writing a message to it gets the proxy's handler task cancelled at
that write instead; the proxy's generator is then closed at its ``yield``
(``GeneratorExit``, which ``send_request_to_replica`` swallows: "async
generator ignored GeneratorExit") and nothing cancels the replica call, so the
engine request runs to ``max_tokens``. Measured on the CPU test app: 1 of 15
gRPC streams cancelled after their first message.

The fix binds each replica call to the proxy task that made it: when that
task ends and the call's stream was not read to its end, the call is
cancelled (Serve then cancels the replica's request, whose lease aborts the
engine request). Installed in each proxy actor by
:func:`specray.serve.loopback.proxy_callback`. It subclasses a private Ray
class: on a Ray without it, it logs a warning and changes nothing.
"""

import asyncio
import logging

log = logging.getLogger("specray.serve")


def cancel_if_unfinished(gen) -> None:
    """``gen``: a Serve ProxyResponseGenerator whose proxy task ended."""
    if not gen._done and not gen.cancelled():
        gen._response.cancel()


def install() -> bool:
    try:
        from ray.serve._private import proxy

        base = getattr(proxy.ProxyResponseGenerator, "specray_base", proxy.ProxyResponseGenerator)
        names = base.__init__.__code__.co_names  # the private attributes cancel_if_unfinished reads
    except (ImportError, AttributeError) as e:
        log.warning("specray: cannot patch Serve's proxy (%s)", e)
        return False
    if not (hasattr(base, "cancelled") and "_response" in names and "_done" in names):
        log.warning("specray: Serve's ProxyResponseGenerator changed; client cancels may not reach replicas")
        return False

    class TaskBoundResponseGenerator(base):
        specray_base = base

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            task = asyncio.current_task()
            if task is not None:
                task.add_done_callback(lambda _: cancel_if_unfinished(self))

    proxy.ProxyResponseGenerator = TaskBoundResponseGenerator
    return True
