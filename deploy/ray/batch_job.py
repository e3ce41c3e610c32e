"""`ray job submit` entry point for batch generation (same flags as
`specray batch`):

    ray job submit --address http://HEAD:8265 --working-dir . \
        --runtime-env deploy/ray/runtime_env.yaml -- \
        python deploy/ray/batch_job.py --input data/in.jsonl --output /shared/out.jsonl \
            --target /models/target --drafter /models/drafter --replicas 4 --device cuda

Inside the job, `ray.init()` joins the cluster through RAY_ADDRESS (set by the
job server); the driver runs on the head node and the replicas wherever Ray
places them, so --input/--output and the model directories must be paths every
node involved can see (shared storage), or relative to the working dir for the
input. The job is resumable: submit the same command again after a failure.

`specray` must be importable on every node: install it in the cluster image,
or ship it with the job through `py_modules` (see runtime_env.yaml):

    python deploy/ray/batch_job.py --stage-py-modules build/py_modules

copies the installed `specray` package (with its `actors` and `kernels`
sub-packages, which live in other source folders) to
build/py_modules/specray, which runtime_env.yaml lists.
"""

import shutil
import sys
from pathlib import Path


def stage_py_modules(dest: str) -> Path:
    """Copy the importable `specray` package tree into DEST/specray (source
    only), laid out as an installed wheel would be."""
    import importlib

    import specray

    out = Path(dest) / "specray"
    if out.exists():
        shutil.rmtree(out)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(Path(specray.__file__).parent, out, ignore=ignore)
    for sub in ("actors", "kernels"):
        mod = importlib.import_module(f"specray.{sub}")
        src = Path(mod.__file__).parent
        if not (out / sub).exists():
            shutil.copytree(src, out / sub, ignore=ignore)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--stage-py-modules"]:
        if len(argv) != 2:
            print("usage: batch_job.py --stage-py-modules DIR", file=sys.stderr)
            return 2
        print(stage_py_modules(argv[1]))
        return 0
    try:
        import specray
        from specray.batch import main as batch_main
    except ImportError as e:
        print(f"batch_job: cannot import specray ({e}); install it on the cluster or ship it with "
              "runtime_env py_modules (see deploy/ray/runtime_env.yaml)", file=sys.stderr)
        return 2
    print(f"batch_job: specray from {Path(specray.__file__).parent}", file=sys.stderr)
    return batch_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
