"""The worker's settings from its environment and arguments (engramd_shared.config)."""

from __future__ import annotations

import pytest

from engramd_client.handles import KINDS, MAPPERS
from engramd_shared.config import CUDA_HANDLE_KINDS, DEFAULT_SOCKET, HANDLE_KINDS, ClientConfig


def test_client_config_from_env() -> None:
    assert ClientConfig.from_env({}) == ClientConfig(socket=DEFAULT_SOCKET, share=None)
    env = {"ENGRAMD_SHARE": "On", "ENGRAMD_SOCKET": "/run/x.sock"}
    assert ClientConfig.from_env(env) == ClientConfig(socket="/run/x.sock", share=True)
    assert ClientConfig.from_env({"ENGRAMD_SHARE": "off"}).share is False
    assert ClientConfig.from_env({"ENGRAMD_FD_SOCKET": "/c/fds"}).fd_socket == "/c/fds"
    assert ClientConfig.from_env({"ENGRAMD_HANDLES": " shm "}).handles == ("shm",)
    assert ClientConfig.from_env({"ENGRAMD_HANDLES": "fabric,shm"}).handles == ("fabric", "shm")
    with pytest.raises(ValueError, match=r"only cuMem kinds.*ENGRAMD_DEVICE"):
        ClientConfig.from_env({"ENGRAMD_HANDLES": "cumem"})
    cumem_only = {"ENGRAMD_HANDLES": "cumem", "ENGRAMD_DEVICE": "cuda:1"}
    assert ClientConfig.from_env(cumem_only).handles == ("cumem",)
    # Every kind a worker may name is a handle kind; those of host memory have their mapper.
    assert tuple(KINDS) == HANDLE_KINDS
    assert set(MAPPERS) == set(HANDLE_KINDS) - set(CUDA_HANDLE_KINDS)
    with pytest.raises(ValueError, match="use cumem,fabric,fd,shm"):
        ClientConfig.from_env({"ENGRAMD_HANDLES": "cuda"})
    # Arguments win over the environment.
    assert ClientConfig.from_env(env, socket="/y", share=False) == ClientConfig("/y", False)
    with pytest.raises(ValueError, match="use auto, on or off"):
        ClientConfig.from_env({"ENGRAMD_SHARE": "maybe"})
    # ENGRAMD_DISK_OFFLOAD: auto (where the set is on disk), on, off.
    assert ClientConfig.from_env({}).disk_offload is None
    assert ClientConfig.from_env({"ENGRAMD_DISK_OFFLOAD": "ON"}).disk_offload is True
    assert ClientConfig.from_env({"ENGRAMD_DISK_OFFLOAD": "off"}).disk_offload is False
    with pytest.raises(ValueError, match=r"ENGRAMD_DISK_OFFLOAD='strict': use auto, on or off"):
        ClientConfig.from_env({"ENGRAMD_DISK_OFFLOAD": "strict"})
