"""Bytecode for what the cluster's processes and the test lanes import, written once by `make setup`.

pip installs the virtualenv with ``--no-compile``: compiling each of its 15,600 modules one after another took 74
of the setup's 138 s on two cores, and a process imports a fifth of them. Importing here what a worker, the proxy,
the CLI and a test lane import compiles that fifth in one process (about 30 CPU-s) and writes its ``__pycache__``.
A module that only some test or command reaches is compiled by the first process that imports it, and written then
(in one suite run, 1,300 modules at 4-6 ms each, schemathesis' and setuptools' most). Compiling every package small
enough instead (4,500 more modules) cost more than that. Run with PYTHONDONTWRITEBYTECODE unset (the Makefile does).
"""
import importlib
import sys
import time

# Third-party first, in the order the processes meet them, then the project's entry points.
MODULES = (
    "torch", "safetensors.torch", "tokenizers", "transformers", "transformers.models.llama.modeling_llama",
    "zmq", "msgpack", "msgspec", "pydantic", "fastapi", "uvicorn", "uvloop", "httptools", "prometheus_client",
    "yaml", "grpc", "redis", "jinja2", "xgrammar", "nixl._api", "triton",
    "pytest", "xdist.dsession", "xdist.remote", "execnet", "hypothesis", "schemathesis", "httpx", "openai",
    "common.cli.main", "proxy.app", "prefill_worker.worker", "decode_worker.worker", "common.engine.model_runner",
    "kv_transfer.nixl_backend", "kv_transfer.zmq_backend", "bench.device_check",
)


def main() -> int:
    if sys.flags.dont_write_bytecode:
        print("compile_imports: PYTHONDONTWRITEBYTECODE is set, so nothing would be written", file=sys.stderr)
        return 2
    started = time.monotonic()
    missing = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an optional package absent on this machine: its users skip or say so
            missing.append(f"{name} ({exc})")
    print(f"compile_imports: {len(sys.modules)} modules imported in {time.monotonic() - started:.1f}s"
          + (f"; not importable here: {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
