"""sd_notify against a real AF_UNIX datagram socket, as systemd listens on one."""
import os
import socket
import uuid

import pytest

from common.runtime import sd_notify


@pytest.fixture
def path_socket(tmp_path):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        yield str(path), sock


@pytest.fixture
def abstract_socket():
    name = f"tessera-test-{os.getpid()}-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        yield "@" + name, sock


def test_ready_sends_one_datagram_with_every_field(path_socket, monkeypatch):
    address, sock = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert sd_notify.ready("proxy serving on 0.0.0.0:8000")
    assert sock.recv(4096).decode() == "READY=1\nSTATUS=proxy serving on 0.0.0.0:8000"


def test_stopping_reaches_an_abstract_namespace_socket(abstract_socket, monkeypatch):
    address, sock = abstract_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert sd_notify.stopping("draining")
    assert sock.recv(4096).decode() == "STOPPING=1\nSTATUS=draining"


def test_without_notify_socket_nothing_is_sent(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify.notify("READY=1") is False


def test_a_vanished_service_manager_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert sd_notify.ready("serving") is False


def test_a_relative_socket_name_is_ignored(monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", "relative.sock")
    assert sd_notify.ready("serving") is False


@pytest.mark.parametrize("field", ["READY", "STATUS=two\nlines"])
def test_malformed_fields_are_rejected(path_socket, monkeypatch, field):
    monkeypatch.setenv("NOTIFY_SOCKET", path_socket[0])
    with pytest.raises(ValueError, match="KEY=value"):
        sd_notify.notify(field)



def test_the_watchdog_pets_at_most_four_times_a_period_and_only_when_healthy(path_socket, monkeypatch):
    address, sock = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    now = [100.0]
    watchdog = sd_notify.Watchdog(clock=lambda: now[0])
    assert watchdog.period == 2.0
    assert watchdog.pet()
    assert sock.recv(4096).decode() == "WATCHDOG=1"
    now[0] += 0.4
    assert not watchdog.pet(), "within a quarter period of the last"
    now[0] += 0.2
    assert not watchdog.pet(healthy=False), "a loop whose other thread stopped turning does not pet"
    assert watchdog.pet()
    assert sock.recv(4096).decode() == "WATCHDOG=1"


@pytest.mark.parametrize("env", [{}, {"WATCHDOG_USEC": "0"}, {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"},
                                 {"WATCHDOG_USEC": "soon"}])
def test_no_watchdog_without_a_period_for_this_process(path_socket, monkeypatch, env):
    monkeypatch.setenv("NOTIFY_SOCKET", path_socket[0])
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    watchdog = sd_notify.Watchdog()
    assert watchdog.period is None
    assert not watchdog.pet()
