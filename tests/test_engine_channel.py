"""engine_channel: the socket between a replica and rank 0's loop, without
Ray: a ChannelServer over an in-process EngineLoop, a ChannelClient on an
event loop. Through Ray the channel carries every stream of the Serve and
Ray-backend tests (test_ray_cluster*, test_serve*, test_faults_*)."""

import asyncio
import socket

import pytest
from factories import make_models
from specray.config import EngineConfig
from specray.engine_channel import ChannelBroken, ChannelClient, ChannelServer, frame
from specray.engine_loop import EngineLoop
from specray.llm import LLM, build_engine
from specray.output_wire import OutputUnpacker
from specray.sampling import SamplingParams

PROMPTS = [[5, 9, 14, 3], [7, 7, 2], [11, 4, 8, 19, 6]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("channel"))


def config(models) -> EngineConfig:
    return EngineConfig(target=str(models / "t"), drafter=str(models / "d"), device="cpu")


@pytest.fixture
def server(models):
    loop = EngineLoop(build_engine(config(models)))
    server = ChannelServer(loop)
    yield server
    server.close()
    loop.stop()


async def collect(client: ChannelClient, ids: set[str], timeout: float = 60.0) -> dict:
    """Every request's last output, rebuilt from the pushes."""
    unpacker, done = OutputUnpacker(), {}
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while set(done) != ids:
        assert loop.time() < end, f"outputs of {ids - set(done)} did not come"
        data = await client.outputs(1.0)
        for out in unpacker.unpack(data) if data is not None else []:
            if out.finished:
                done[out.request_id] = out
    return done


def test_requests_in_and_outputs_pushed_equal_the_in_process_engine(models, server):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM(models / "t", models / "d", device="cpu").generate(PROMPTS, params)]

    async def run():
        client = await ChannelClient.connect(server.address, server.secret)
        errors = await client.submit([(p, params, f"r{i}") for i, p in enumerate(PROMPTS)])
        assert errors == [None, None, None]
        # a bad request is refused in its answer, as through Ray, and the rest are taken
        bad = await client.submit([([1, 2], {"max_tokens": 0}, "bad"), ([3, 4], params, "r0")])
        assert isinstance(bad[0], ValueError) and "already in use" in str(bad[1])
        done = await collect(client, {"r0", "r1", "r2"})
        client.close()
        return done

    done = asyncio.run(run())
    assert [done[f"r{i}"].token_ids for i in range(3)] == expected


def test_an_abort_through_the_channel_ends_the_request(server):
    async def run():
        client = await ChannelClient.connect(server.address, server.secret)
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        assert await client.submit([([5, 9, 14], long, "long")]) == [None]
        await client.outputs(30.0)  # it runs
        client.abort(["long"])
        out = (await collect(client, {"long"}))["long"]
        client.close()
        return out

    out = asyncio.run(run())
    assert out.finish_reason == "abort" and len(out.token_ids) < 400


def test_a_connection_without_the_secret_is_refused(server):
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(frame(b"not the secret"))
        s.settimeout(10)
        assert s.recv(1) == b""  # closed on it, nothing submitted
    assert server.loop.num_unfinished() == 0

    async def run():
        client = await ChannelClient.connect(server.address, b"wrong" * 4)
        with pytest.raises(ChannelBroken):
            await client.submit([([5, 9], SamplingParams(max_tokens=2), "x")])

    asyncio.run(run())
    assert server.loop.num_unfinished() == 0


def test_the_loop_stopping_reaches_the_client_as_its_reason(models):
    loop = EngineLoop(build_engine(config(models)))
    server = ChannelServer(loop)

    async def run():
        client = await ChannelClient.connect(server.address, server.secret)
        assert await client.submit([([5, 9], SamplingParams(max_tokens=400, ignore_eos=True), "r")]) == [None]
        await asyncio.to_thread(loop.stop)
        done = await collect(client, {"r"})  # its last output: aborted by the stop
        with pytest.raises(RuntimeError, match="shut down"):
            while True:
                await client.outputs(5.0)
        return done

    try:
        done = asyncio.run(run())
    finally:
        server.close()
    assert done["r"].finish_reason == "abort"


def test_a_server_gone_breaks_the_client_at_once(models, server):
    async def run():
        client = await ChannelClient.connect(server.address, server.secret)
        assert await client.submit([([5, 9], SamplingParams(max_tokens=400, ignore_eos=True), "r")]) == [None]
        server.close()
        with pytest.raises(ChannelBroken):
            for _ in range(100):
                await client.outputs(1.0)
        with pytest.raises(ChannelBroken):
            await client.submit([([5, 9], SamplingParams(max_tokens=2), "s")])

    asyncio.run(run())


def test_close_from_another_thread_ends_a_waiting_reader(server):
    """An engine's shutdown may run off the event loop that made its channel."""
    async def run():
        client = await ChannelClient.connect(server.address, server.secret)
        waiting = asyncio.ensure_future(client.outputs(30.0))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(client.close)
        with pytest.raises(ChannelBroken):
            await asyncio.wait_for(waiting, 5)

    asyncio.run(run())
