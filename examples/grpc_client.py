"""Stream one request from a running specray server over gRPC.

    specray serve --target DIR --drafter DIR            # HTTP :8000, gRPC :9000
    python examples/grpc_client.py "The capital of France is" --max-tokens 32
    python examples/grpc_client.py --chat "What is the capital of France?"

Prints the text as it arrives, then the finish reason, usage and the
speculative decoding stats of the last message.
"""

import argparse
import os
import sys

import grpc

from specray.serve import specray_pb2 as pb
from specray.serve import specray_pb2_grpc as pb_grpc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", default="The capital of France is")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--api-key", default=os.environ.get("SPECRAY_API_KEY"))
    p.add_argument("--application", help="Serve application name (needed only when several run)")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)

    params = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        params.seed = args.seed
    request = pb.GenerateRequest(params=params)
    if args.chat:
        request.messages.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    metadata = []
    if args.api_key:
        metadata.append(("authorization", f"Bearer {args.api_key}"))
    if args.application:
        metadata.append(("application", args.application))

    with grpc.insecure_channel(f"{args.host}:{args.port}") as channel:
        stub = pb_grpc.SpecRayStub(channel)
        token_ids, last = [], None
        try:
            for msg in stub.Generate(request, metadata=metadata, timeout=args.timeout):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                token_ids.extend(msg.token_ids)
                last = msg
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print()
    s = last.stats
    print(f"finish_reason={last.finish_reason} tokens={len(token_ids)} "
          f"usage=({last.usage.prompt_tokens} prompt, {last.usage.completion_tokens} completion) "
          f"ttft={last.ttft_s:.3f}s")
    print(f"mean_acceptance_length={s.mean_acceptance_length:.3f} steps={len(s.acceptance_lengths)} "
          f"accepted={s.num_accepted_tokens}/{s.num_draft_tokens} per_position={list(s.accepted_per_position)}")
    print(f"token_ids={token_ids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
