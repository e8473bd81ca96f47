"""Bytecode for what the cluster's processes and the test lanes import, written once by `make setup`.

pip installs the virtualenv with ``--no-compile``: compiling every one of its 15,600 modules, one after another, was
most of the setup's time, and a process imports a fifth of them. Importing here what a worker, the proxy, the CLI,
the embedded model's conversion and a test lane import compiles that fifth in one process and writes it. A module
that only some test or command reaches is compiled by the first process that imports it, and written then where
PYTHONDONTWRITEBYTECODE is unset, as the Makefile's targets unset it. The measurements, and what compiling more
here cost: docs/benchmarks.md, "The test suite on two cores".
"""
import importlib
import sys
import time

# Third-party, in the order the processes meet them; a package this machine lacks is left to its users to report.
THIRD_PARTY = (
    "torch", "safetensors.torch", "tokenizers", "transformers", "transformers.models.llama.modeling_llama",
    "zmq", "msgpack", "msgspec", "pydantic", "fastapi", "uvicorn", "uvloop", "httptools", "prometheus_client",
    "yaml", "grpc", "grpc_status", "google.protobuf.json_format", "redis", "jinja2", "xgrammar", "nixl._api",
    "triton", "gguf", "accelerate", "transformers.modeling_gguf_pytorch_utils", "transformers.integrations.ggml",
    "pytest", "xdist.dsession", "xdist.remote", "execnet", "hypothesis", "schemathesis", "httpx", "openai",
)
# The project's entry points: each must import, or setup fails.
PROJECT = (
    "common.cli.main", "proxy.app", "proxy.edge.grpc_api.service", "prefill_worker.worker", "decode_worker.worker",
    "common.engine.model_runner", "common.storage.gguf_convert", "kv_transfer.nixl_backend",
    "kv_transfer.zmq_backend", "bench.device_check",
)


def main() -> int:
    if sys.flags.dont_write_bytecode:
        print("compile_imports: PYTHONDONTWRITEBYTECODE is set, so nothing would be written", file=sys.stderr)
        return 2
    started = time.monotonic()
    missing = []
    for name in THIRD_PARTY:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    for name in PROJECT:
        importlib.import_module(name)
    print(f"compile_imports: {len(sys.modules)} modules imported in {time.monotonic() - started:.1f}s"
          + (f"; not importable here: {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
