"""One override grammar everywhere: ``--set [ROLE:]KEY=VALUE`` on every role's command, ``tessera config check``
and ``tessera up``."""
from __future__ import annotations

import pytest

from common.cli.local_cluster import LocalCluster
from common.config.base import ConfigError
from common.config.roles import parse_overrides, split_override

SHARED = ["heartbeat_interval_s=0.5", "decode:engine.max_num_seqs=64", "proxy:port=9000",
          "proxy_address=tcp://10.0.0.1:5555"]


def test_a_colon_after_the_equals_sign_is_the_values():
    assert split_override("proxy_address=tcp://h:5555") == (None, "proxy_address", "tcp://h:5555")
    assert split_override("decode:engine.dtype=bfloat16") == ("decode", "engine.dtype", "bfloat16")
    for bad in ("novalue", "=1", "decode:=1"):
        with pytest.raises(ConfigError, match=r"\[ROLE:\]KEY=VALUE"):
            split_override(bad)


def test_one_list_serves_every_role_each_taking_its_own():
    assert parse_overrides(SHARED, "decode") == {"heartbeat_interval_s": 0.5, "engine": {"max_num_seqs": 64},
                                                 "proxy_address": "tcp://10.0.0.1:5555"}
    assert parse_overrides(SHARED, "proxy") == {"heartbeat_interval_s": 0.5, "port": 9000,
                                                "proxy_address": "tcp://10.0.0.1:5555"}
    assert parse_overrides(SHARED, "prefill") == {"heartbeat_interval_s": 0.5,
                                                  "proxy_address": "tcp://10.0.0.1:5555"}


def test_an_unknown_role_prefix_is_refused_by_name():
    with pytest.raises(ConfigError, match="'decoder' is no role"):
        parse_overrides(["decoder:engine.dtype=float32"], "decode")


def test_up_gives_an_unprefixed_field_to_the_processes_whose_config_has_it():
    cluster = LocalCluster(threads=1, role_overrides=["engine.max_num_seqs=8", "requests.retry_after_s=2",
                                                      "decode-1:engine.dtype=float32", "prefill:worker_id=p"])
    spawned = {}
    cluster._spawn = lambda name, args: spawned.setdefault(name, args)
    cluster.start_proxy()
    for role, index in (("prefill", 0), ("decode", 0), ("decode", 1)):
        cluster.start_worker(role, index)
    assert "requests.retry_after_s=2" in spawned["proxy"] and "engine.max_num_seqs=8" not in spawned["proxy"]
    assert all("engine.max_num_seqs=8" in spawned[name] for name in ("prefill-0", "decode-0", "decode-1"))
    assert "engine.dtype=float32" in spawned["decode-1"] and "engine.dtype=float32" not in spawned["decode-0"]
    assert "worker_id=p" in spawned["prefill-0"] and "worker_id=p" not in spawned["decode-0"]


def test_up_refuses_a_field_no_role_has():
    cluster = LocalCluster(threads=1, role_overrides=["no_such_field=1"])
    cluster._spawn = lambda name, args: None
    with pytest.raises(ConfigError, match="no role's config has 'no_such_field'"):
        cluster.start_proxy()
