"""``tessera status``: a running cluster as its proxy sees it: readiness, version, and each worker's role, model,
load, KV pages and heartbeat (the admin API's ``GET /admin/workers``, which needs the admin key)."""
from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from pathlib import Path

TIMEOUT_S = 10.0


def add_status_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "status", help="show a running cluster: workers, roles, models, load, KV pages and health",
        description="Asks a running proxy for its readiness and version and, with the admin key, for every "
        "worker it has: role, model@version, running sequences, KV pages free, last heartbeat.")
    parser.add_argument("--proxy", metavar="URL", default="http://127.0.0.1:8000",
                        help="the proxy's HTTP address (default: %(default)s)")
    parser.add_argument("--admin-key-file", metavar="FILE",
                        help="file holding the admin key whose sha256 is the proxy's admin_api_key_sha256; "
                        "without it only readiness and version are shown")
    parser.add_argument("--json", action="store_true", help="print what the proxy answered as JSON")
    parser.set_defaults(handler=_status)


def _get(url: str, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _status(args: argparse.Namespace) -> int:
    base = args.proxy.rstrip("/")
    try:
        _, version = _get(f"{base}/version")
        ready_code, ready = _get(f"{base}/readyz")
        workers = None
        if args.admin_key_file:
            code, workers = _get(f"{base}/admin/workers", Path(args.admin_key_file).read_text().strip())
            if code != 200:
                print(f"tessera status: the proxy refused /admin/workers ({code}): "
                      f"{workers.get('error', {}).get('message', '')}")
                return 1
    except (urllib.error.URLError, OSError) as error:
        print(f"tessera status: cannot reach the proxy at {base}: {getattr(error, 'reason', error)}")
        return 1
    if args.json:
        print(json.dumps({"version": version, "ready": ready, "workers": workers}, indent=2))
        return 0 if ready_code == 200 else 1
    reason = ready.get("reason") or ready.get("error", {}).get("message", "")
    print(f"proxy {base}: tessera {version.get('version')}, wire protocol {version.get('protocol_version')}; "
          f"{'ready' if ready_code == 200 else 'NOT READY'}: {reason}")
    for name, versions in sorted(version.get("models", {}).items()):
        print(f"model {name}: {', '.join(versions)}")
    if workers is None:
        print("workers: pass --admin-key-file to list them")
    else:
        _print_workers(workers["data"])
    return 0 if ready_code == 200 else 1


def _print_workers(rows: list[dict]) -> None:
    table = [("WORKER", "ROLE", "MODEL", "TP", "STATE", "RUNNING", "KV PAGES FREE", "HEARTBEAT", "PROTOCOL")]
    for w in rows:
        table.append((w["worker_id"], w["role"], f"{w['model']}@{w['version']}", str(w["tensor_parallel_size"]),
                      "draining" if w["draining"] else "serving", f"{w['running']}/{w['decode_slots']}",
                      f"{w['kv_pages_free']}/{w['kv_pages_total']}", f"{w['heartbeat_age_s']:.1f}s ago",
                      str(w["protocol_version"] or "")))
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    if not rows:
        print("(no worker registered)")
