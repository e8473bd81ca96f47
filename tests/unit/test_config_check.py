"""Config validation messages, ``tessera config check`` and ``tessera curve-keys generate``."""
from __future__ import annotations

import json
import os
import pwd
import stat
from pathlib import Path

import pytest
import zmq
import zmq.auth

from common.cli.main import main
from common.config.base import ConfigError, EngineConfig
from common.config.roles import ProxyConfig, WorkerConfig, build, load_config, parse_overrides

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").rglob("*.yaml"))
needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")


def error_of(cls, data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        build(cls, data)
    return str(caught.value)


@pytest.mark.parametrize("cls, data, words", [
    (ProxyConfig, {"prot": 1}, ["unknown proxy config field 'prot'", "did you mean 'port'?"]),
    (WorkerConfig, {"engine": {"max_num_seq": 2}}, ["'max_num_seq'", "did you mean 'max_num_seqs'?"]),
    (ProxyConfig, {"tenancy": {"tenants": [{"name": "a", "wieght": 2}]}}, ["'wieght'", "did you mean 'weight'?"]),
    (ProxyConfig, {"zzzz": 1}, ["unknown proxy config field 'zzzz'", "known fields:", "worker_bind"]),
])
def test_unknown_keys_name_the_closest_known_field(cls, data, words):
    message = error_of(cls, data)
    for word in words:
        assert word in message


@pytest.mark.parametrize("cls, data, words", [
    (WorkerConfig, {"role": "mixed"}, ["'role' = 'mixed'", "one of 'prefill', 'decode', 'both'"]),
    (WorkerConfig, {"transfer_backend": "rdma"}, ["'transfer_backend'", "'nixl'", "'zmq'"]),
    (WorkerConfig, {"engine": {"dtype": "float16"}}, ["'engine.dtype' = 'float16'", "'bfloat16'"]),
    (WorkerConfig, {"engine": {"block_size": 12}}, ["'engine.block_size' = 12", "one of 8, 16, 32"]),
    (ProxyConfig, {"heartbeat_timeout_s": 0}, ["'heartbeat_timeout_s' = 0", "> 0"]),
    (WorkerConfig, {"engine": {"num_kv_blocks": 1}}, ["'engine.num_kv_blocks' = 1", ">= 2 (or null)"]),
    (ProxyConfig, {"port": "http"}, ["'port' = 'http'", "expected int"]),
    (ProxyConfig, {"http": {"max_connections": True}}, ["'http.max_connections' = True", "expected int"]),
    (ProxyConfig, {"tenancy": {"fairness_policy": "lifo"}}, ["'tenancy.fairness_policy'", "'vtc'"]),
    (ProxyConfig, {"requests": {"max_tokens_limit": 100}}, ["in requests:", "'max_tokens_default' = 256",
                                                        "<= max_tokens_limit (100)"]),
])
def test_bad_values_name_the_field_and_what_it_allows(cls, data, words):
    message = error_of(cls, data)
    for word in words:
        assert word in message


@pytest.mark.parametrize("cls, data, words", [
    (ProxyConfig, {"security": {"tls_cert_file": "c.pem"}}, ["'tls_key_file' is empty", "'tls_cert_file' is set"]),
    (ProxyConfig, {"security": {"tls_ca_file": "ca.pem"}}, ["'tls_ca_file' needs tls_cert_file"]),
    (ProxyConfig, {"security": {"curve_secret_key_file": "k"}}, ["'curve_authorized_keys_dir' is empty"]),
    (WorkerConfig, {"security": {"curve_secret_key_file": "k", "curve_authorized_keys_dir": "d"}},
     ["'curve_proxy_public_key_file' is empty"]),
    (WorkerConfig, {"security": {"curve_secret_key_file": "k", "curve_proxy_public_key_file": "p"}},
     ["'security.curve_authorized_keys_dir' is empty", "zmq backend"]),
])
def test_fields_that_go_together(cls, data, words):
    message = error_of(cls, data)
    for word in words:
        assert word in message


def test_a_nixl_worker_needs_no_peer_keys_directory():
    config = build(WorkerConfig, {"transfer_backend": "nixl",
                                  "security": {"curve_secret_key_file": "k", "curve_proxy_public_key_file": "p"}})
    assert config.security.curve_authorized_keys_dir == ""


def test_integers_are_accepted_for_float_fields():
    config = build(ProxyConfig, {"heartbeat_timeout_s": 3})
    assert config.heartbeat_timeout_s == 3.0 and type(config.heartbeat_timeout_s) is float
    assert EngineConfig(model="m").max_model_len is None  # null stays null


def test_loading_checks_that_named_files_exist(tmp_path):
    with pytest.raises(ConfigError, match=r"'security.tls_cert_file' = '.*nope.pem': no such file"):
        load_config(ProxyConfig, None, {"security": {"tls_cert_file": str(tmp_path / "nope.pem"),
                                                     "tls_key_file": str(tmp_path / "nope.key")}})
    with pytest.raises(ConfigError, match="'security.curve_authorized_keys_dir' = .*: no such dir"):
        load_config(ProxyConfig, None, {"security": {"curve_secret_key_file": __file__,
                                                     "curve_authorized_keys_dir": str(tmp_path / "none")}})


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(p.parents[1])) for p in CONFIGS])
def test_every_shipped_config_file_checks_out(path, capsys):
    role = ["--role", "proxy"] if path.stem == "proxy" else []
    assert main(["config", "check", str(path), *role]) == 0, capsys.readouterr().err
    assert f"{path}: OK" in capsys.readouterr().out


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, args, words", [
    ("port: 8001\n", [], ["has no 'role:' key", "--role proxy"]),
    ("role: decode\n", ["--role", "prefill"], ["says role: 'decode' but --role is 'prefill'"]),
    ("role: decode\nengine: {max_num_seq: 4}\n", [], ["did you mean 'max_num_seqs'?"]),
    ("port: [1\n", ["--role", "proxy"], ["invalid"]),
    ("- a\n", ["--role", "proxy"], ["expected a mapping"]),
    ("security: {tls_cert_file: {f}, tls_key_file: {f}}\n", ["--role", "proxy"],
     ["'security.tls_cert_file'", "'security.tls_key_file'", "not a matching PEM certificate and key"]),
])
def test_check_fails_with_exit_2_and_the_reason(tmp_path, capsys, text, args, words):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    assert main(["config", "check", write(tmp_path, text.replace("{f}", str(garbage))), *args]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_check_applies_overrides_and_summarizes(tmp_path, capsys):
    path = write(tmp_path, "role: prefill\ntransfer_backend: zmq\n")
    assert main(["config", "check", path, "--set", "engine.dtype=bfloat16", "--set", "port=1"]) == 2
    assert "unknown worker config field 'port'" in capsys.readouterr().err
    assert main(["config", "check", path, "--set", "engine.dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "role: prefill" in out and "(bfloat16)" in out and "KV transfer zmq" in out
    assert "CURVE: off" in out


@needs_curve
def test_curve_keys_generate_writes_a_private_pair_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "keys"
    assert main(["curve-keys", "generate", "--out", str(out), "--name", "prefill-0"]) == 0
    public, secret = out / "prefill-0.key", out / "prefill-0.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    public_key, secret_key = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (public_key, None) and secret_key is not None
    assert main(["curve-keys", "generate", "--out", str(out), "--name", "prefill-0"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert zmq.auth.load_certificate(secret) == (public_key, secret_key)
    assert main(["curve-keys", "generate", "--out", str(out), "--name", "../escape"]) == 2


@needs_curve
def test_curve_keys_generate_gives_the_pair_to_the_service_user(tmp_path, capsys):
    """As with sudo: the directory and both files belong to --owner, the secret still 0600."""
    nobody = pwd.getpwnam("nobody")
    out = tmp_path / "keys"
    assert main(["curve-keys", "generate", "--out", str(out), "--name", "w0", "--owner", "nobody:no-such-group"]) == 2
    assert main(["curve-keys", "generate", "--out", str(out), "--name", "w0", "--owner", "no-such-user"]) == 2
    assert "no user 'no-such-user'" in capsys.readouterr().err and not out.exists()  # refused before writing
    code = main(["curve-keys", "generate", "--out", str(out), "--name", "w0", "--owner", "nobody"])
    if os.geteuid() != 0:
        assert code == 2 and "without root" in capsys.readouterr().err
        return
    assert code == 0
    for path in (out, out / "w0.key", out / "w0.key_secret"):
        assert (path.stat().st_uid, path.stat().st_gid) == (nobody.pw_uid, nobody.pw_gid), path
    assert stat.S_IMODE((out / "w0.key_secret").stat().st_mode) == 0o600


@needs_curve
def test_check_opens_the_curve_key_files(tmp_path, capsys):
    keys = tmp_path / "keys"
    for name in ("proxy", "w0"):
        assert main(["curve-keys", "generate", "--out", str(keys), "--name", name]) == 0
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    proxy = write(tmp_path, f"security:\n  curve_secret_key_file: {keys / 'proxy.key_secret'}\n"
                            f"  curve_authorized_keys_dir: {authorized}\n")
    assert main(["config", "check", proxy, "--role", "proxy"]) == 2
    assert "holds no public key (*.key) file" in capsys.readouterr().err
    (authorized / "w0.key").write_bytes((keys / "w0.key").read_bytes())
    assert main(["config", "check", proxy, "--role", "proxy"]) == 0
    assert "CURVE: on" in capsys.readouterr().out
    swapped = ["--set", f"security.curve_secret_key_file={keys / 'proxy.key'}"]
    assert main(["config", "check", proxy, "--role", "proxy", *swapped]) == 2
    assert "'security.curve_secret_key_file'" in (err := capsys.readouterr().err) and "holds no secret key" in err
    worker = ["--role", "decode", "--set", f"security.curve_secret_key_file={keys / 'w0.key_secret'}",
              "--set", f"security.curve_proxy_public_key_file={keys / 'proxy.key'}",
              "--set", f"security.curve_authorized_keys_dir={authorized}"]
    assert main(["config", "check", write(tmp_path, "{}\n"), *worker]) == 0
    not_a_key = ["--set", f"security.curve_proxy_public_key_file={__file__}"]
    assert main(["config", "check", write(tmp_path, "{}\n"), *worker, *not_a_key]) == 2
    assert "'security.curve_proxy_public_key_file'" in capsys.readouterr().err


@pytest.mark.parametrize("cls, data, place", [
    (ProxyConfig, {"ttft_slo_ms": 500}, "slo.ttft_slo_ms"),
    (ProxyConfig, {"shared_state_interval_s": 0.5}, "shared_state.interval_s"),
    (ProxyConfig, {"tls_cert_file": "c.pem"}, "security.tls_cert_file"),
    (WorkerConfig, {"metrics_port": 9100}, "observability.metrics_port"),
    (WorkerConfig, {"fault_kv_pull_delay_s": 1.0}, "testing.fault_kv_pull_delay_s"),
    (WorkerConfig, {"engine": {"spec_method": "ngram"}}, "engine.spec.method"),
    (WorkerConfig, {"engine": {"int8_smoothing": 0.5}}, "engine.int8.smoothing"),
])
def test_a_key_from_before_the_sections_names_its_new_place(cls, data, place):
    assert f"has moved into a section: set {place}" in error_of(cls, data)
    key = next(iter(data))
    overrides = parse_overrides([f"{key}.{next(iter(data[key]))}=1" if key == "engine" else f"{key}=1"])
    assert place in error_of(cls, overrides)


def test_a_deprecated_key_still_loads_with_a_warning(tmp_path, caplog):
    from common.config.roles import WorkerConfig, load_config

    path = tmp_path / "prefill.yaml"
    path.write_text("role: prefill\nkv_lease_s: 30.0\n")
    with caplog.at_level("WARNING", logger="tessera.config"):
        config = load_config(WorkerConfig, path)
    assert config.role == "prefill" and not hasattr(config, "kv_lease_s")
    assert "kv_lease_s" in caplog.text and "deprecated" in caplog.text


def test_errors_name_nested_fields_by_their_path_and_list_every_bad_field():
    message = error_of(ProxyConfig, {"port": 0, "tenancy": {"tenants": [{"name": "team-a", "weight": -1}]}})
    assert "'port' = 0 is invalid: > 0" in message
    assert "tenancy.tenants['team-a'].weight" in message and "-1" in message
    assert "'tenancy.tenants[0].name' is required" in error_of(ProxyConfig, {"tenancy": {"tenants": [{"weight": 1}]}})
    assert "'engine' = 5 is invalid: expected a mapping" in error_of(WorkerConfig, {"engine": 5})
    assert "in engine.spec:" in error_of(WorkerConfig, {"engine": {"spec": {"method": "draft"}}})


def test_yaml_strings_and_booleans_are_not_taken_for_numbers():
    assert "expected int" in error_of(ProxyConfig, {"port": "8000"})
    assert "expected float" in error_of(ProxyConfig, {"tenancy": {"queue_timeout_s": True}})
    assert "expected bool" in error_of(ProxyConfig, {"tenancy": {"auth_enabled": "yes"}})


def test_the_schema_command_prints_the_json_schema_that_validates(capsys):
    assert main(["config", "schema", "worker"]) == 0
    schema = json.loads(capsys.readouterr().out)
    engine = schema["$defs"]["EngineConfig"]["properties"]
    assert engine["dtype"]["enum"] == ["float32", "bfloat16"]
    assert engine["max_num_seqs"]["minimum"] == 1 and engine["max_num_seqs"]["default"] == 128
    assert schema["additionalProperties"] is False and "role" in schema["properties"]


def test_yaml_off_and_on_stay_words_so_a_settings_choice_of_them_loads(tmp_path):
    """YAML 1.1 reads off/on/yes/no as booleans; a config reads YAML 1.2's (true and false only), so a choice named
    off loads from a file and from an override, and a boolean field given one of those words names what it wants."""
    path = tmp_path / "worker.yaml"
    path.write_text("engine:\n  spec:\n    method: off\n  cpu:\n    compact_panels: off\n")
    config = load_config(WorkerConfig, path, parse_overrides(["engine.cpu.prepack_weights=false"]))
    assert (config.engine.spec.method, config.engine.cpu.compact_panels) == ("off", "off")
    assert config.engine.cpu.prepack_weights is False
    assert parse_overrides(["engine.spec.method=off", "engine.cpu.prepack_weights=true"]) == {
        "engine": {"spec": {"method": "off"}, "cpu": {"prepack_weights": True}}}
    with pytest.raises(ConfigError, match="prepack_weights' = 'no' is invalid: expected bool"):
        load_config(WorkerConfig, None, parse_overrides(["engine.cpu.prepack_weights=no"]))
