"""Shared pieces of the Ray backend tests (test_ray_cluster.py,
test_ray_cluster_lifecycle.py): a local CPU Ray cluster on loopback with tiny
random models, the engine config they run, and the in-process engine's
tokens they are held to."""

from factories import make_models
from specray import LLM
from specray.config import EngineConfig

PROMPTS = [[5, 17, 33, 2, 9, 10, 42], [3, 4], list(range(2, 40)), [7] * 15, [11, 12, 13]]  # token ids
MAX_TOKENS = [30, 24, 17, 33, 20]


def start_cluster(tmp_path_factory):
    """For a module's ``cluster`` fixture: a Ray of 8 CPUs on 127.0.0.1 for
    the module's tests, yielding the models' directory; shut down after."""
    import ray

    ray.init(address="local", num_cpus=8, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="ERROR")
    yield make_models(tmp_path_factory.mktemp("ray"))
    ray.shutdown()


def config(root, **kw):
    return EngineConfig(target=str(root / "t"), drafter=str(root / "d"), num_kv_blocks=300, kv_block_size=4, **kw)


def reference(root, params):
    llm = LLM(root / "t", root / "d")
    return [o.token_ids for o in llm.generate(PROMPTS, params)]
