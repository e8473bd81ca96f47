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

