"""deploy/prometheus/alerts.yml: valid rules (`promtool check rules`) that fire on what they are about and stay
quiet on a healthy cluster (`promtool test rules tests/prometheus/alerts_test.yml`), loaded by prometheus.yml."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "tests" / "prometheus" / "alerts_test.yml"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package "
                                    "'prometheus'; .ci/run installs it)")


@needs_promtool
def test_the_rules_check():
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_each_alert_fires_on_its_case_and_not_on_a_healthy_one():
    result = subprocess.run([PROMTOOL, "test", "rules", RULE_TESTS.name], capture_output=True, text=True,
                            cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_test_and_the_scrape_config_loads_the_rules():
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    tested = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test.get("alert_rule_test", [])}
    assert alerts == tested, f"alerts without a promtool test: {sorted(alerts - tested)}"
    assert "alerts.yml" in yaml.safe_load((RULES.parent / "prometheus.yml").read_text())["rule_files"]
