"""The deployment files: systemd units verify, manifests validate, and all agree with the daemon."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import Daemon, as_user
from engramd_shared.config import DEFAULT_SOCKET

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SOCKET_DIR = str(Path(DEFAULT_SOCKET).parent)


def _args(container: dict[str, Any]) -> dict[str, str]:
    """--flag=value arguments of a container."""
    flags = [a[2:] for a in container.get("args", []) if a.startswith("--") and "=" in a]
    return dict(f.split("=", 1) for f in flags)


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def _manifest(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "kubernetes" / name).read_text())
    return doc


def test_systemd_units_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # verify checks that ExecStart exists: point it at this checkout's engramd.
    engramd = Path(sys.executable).with_name("engramd")
    unit = (DEPLOY / "systemd" / "engramd.service").read_text()
    unit = unit.replace("/usr/local/bin/engramd", str(engramd))
    (tmp_path / "engramd.service").write_text(unit)
    others = ["srv-engramd-shm.mount", "srv-engramd-huge.mount", "engramd-hugepages.service"]
    for name in others:
        shutil.copy(DEPLOY / "systemd" / name, tmp_path)
    result = subprocess.run(
        [
            analyze,
            "verify",
            "--man=no",
            str(tmp_path / "engramd.service"),
            *(str(tmp_path / name) for name in others),
        ],
        capture_output=True,
        text=True,
    )
    problems = [ln for ln in result.stderr.splitlines() if "engramd" in ln or ".mount" in ln]
    assert result.returncode == 0 and not problems, result.stderr


def test_systemd_unit_matches_the_daemon() -> None:
    unit = (DEPLOY / "systemd" / "engramd.service").read_text()
    assert "Type=notify" in unit
    assert "After=local-fs.target network-online.target" in unit
    assert "RuntimeDirectory=engramd" in unit and DEFAULT_SOCKET.startswith("/run/engramd/")
    assert "LimitMEMLOCK=infinity" in unit
    assert "LimitNOFILE=1048576" in unit
    assert "RemoveIPC=no" in unit
    assert "FileDescriptorStoreMax=" in unit  # memfd sets outlive a restart
    tmpfiles = (DEPLOY / "systemd" / "engramd.tmpfiles.conf").read_text()
    assert "d /dev/shm/engramd 0750 engramd engramd -" in tmpfiles
    for forbidden in ("PrivateDevices=yes", "PrivateIPC=yes", "MemoryDenyWriteExecute=yes"):
        assert forbidden not in unit
    mount = (DEPLOY / "systemd" / "srv-engramd-shm.mount").read_text()
    assert "huge=within_size" in mount and "Where=/srv/engramd/shm" in mount
    huge = (DEPLOY / "systemd" / "srv-engramd-huge.mount").read_text()
    assert "Type=hugetlbfs" in huge and "pagesize=1G" in huge
    assert "z /srv/engramd/huge 0750 engramd engramd -" in tmpfiles
    reserve = (DEPLOY / "systemd" / "engramd-hugepages.service").read_text()
    assert (
        "hugepages-1048576kB/nr_hugepages" in reserve and "Before=srv-engramd-huge.mount" in reserve
    )


@pytest.mark.parametrize(
    "name",
    [
        "daemonset.yaml",
        "sidecar.yaml",
        "engine-pod.yaml",
        "peers-service.yaml",
        "peer-token-secret.yaml",
    ],
)
def test_manifests_validate(name: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(_manifest(name), version, strict=True)


def test_daemonset_agrees_with_the_daemon() -> None:
    spec = _manifest("daemonset.yaml")["spec"]["template"]["spec"]
    [daemon] = spec["containers"]
    args = _args(daemon)
    assert args["socket"] == DEFAULT_SOCKET
    assert _mounts(daemon)[SOCKET_DIR] == "socket"
    assert _mounts(daemon)[args["shm-dir"]] == "shm"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["socket"]["hostPath"]["path"] == SOCKET_DIR
    assert volumes["shm"]["hostPath"]["path"] == "/dev/shm"
    health = int(args["health-port"])
    assert {p["containerPort"] for p in daemon["ports"]} >= {health}
    for probe in ("startupProbe", "readinessProbe"):
        assert daemon[probe]["grpc"]["port"] == health
    # The kubelet probes the pod IP: the port must not be bound to loopback.
    assert args["health-address"] == "$(POD_IP)"
    assert "IPC_LOCK" in daemon["securityContext"]["capabilities"]["add"]

    engine = _manifest("engine-pod.yaml")["spec"]
    [worker] = engine["containers"]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["ENGRAMD_SOCKET"] == args["socket"]
    # Descriptors come through the socket folder: nothing of the node's /dev/shm.
    assert _mounts(worker)[SOCKET_DIR] == "socket"
    assert not any(m.startswith("/dev/shm") for m in _mounts(worker))
    assert not engine.get("hostIPC")
    engine_volumes = {v["name"]: v for v in engine["volumes"]}
    assert engine_volumes["socket"]["hostPath"]["path"] == SOCKET_DIR
    assert not any(
        v.get("hostPath", {}).get("path", "").startswith("/dev/shm")
        for v in engine_volumes.values()
    )
    group = daemon["securityContext"]["runAsGroup"]
    assert group in engine["securityContext"]["supplementalGroups"]


def test_sidecar_shares_only_the_socket_folder() -> None:
    spec = _manifest("sidecar.yaml")["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    args = _args(containers["engramd"])
    volumes = {v["name"]: v for v in spec["volumes"]}
    # The daemon's tables on 1 GiB pages, asked for as a resource.
    assert volumes["shm"]["emptyDir"]["medium"] == "HugePages-1Gi"
    daemon = containers["engramd"]
    assert (
        daemon["resources"]["limits"]["hugepages-1Gi"]
        == (daemon["resources"]["requests"]["hugepages-1Gi"])
    )
    assert "emptyDir" in volumes["socket"]
    for c in containers.values():
        assert _mounts(c)[SOCKET_DIR] == "socket"
    assert _mounts(daemon)[args["shm-dir"]] == "shm"
    [prepare] = spec["initContainers"]
    assert f"chmod 1777 {args['shm-dir']}" in prepare["command"][-1]
    # The engine's /dev/shm is its own: the tables come as descriptors.
    assert _mounts(containers["engine"])["/dev/shm"] == "engine-shm"
    assert "shm" not in _mounts(containers["engine"]).values()
    env = {e["name"]: e.get("value") for e in containers["engine"]["env"]}
    assert env["ENGRAMD_SOCKET"] == args["socket"] == DEFAULT_SOCKET
    assert containers["engramd"]["readinessProbe"]["grpc"]["port"] == int(args["health-port"])


def test_compose_shares_only_the_socket_folder() -> None:
    doc = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    daemon, engine = doc["services"]["engramd"], doc["services"]["engine"]
    assert "ipc" not in daemon and "ipc" not in engine and "shm_size" not in daemon
    assert "--backing=memfd" in daemon["command"]
    socket_volume = f"engramd-socket:{SOCKET_DIR}"
    assert socket_volume in daemon["volumes"] and socket_volume in engine["volumes"]
    assert engine["environment"]["ENGRAMD_SOCKET"] == DEFAULT_SOCKET
    assert f"--socket={DEFAULT_SOCKET}" in daemon["command"]


def _engine_mounts() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(manifest, engine container, its volumes) of every manifest that runs an engine."""
    found = []
    for name, container in (("engine-pod.yaml", "engine"), ("sidecar.yaml", "engine")):
        spec = _manifest(name)["spec"]
        [engine] = [c for c in spec["containers"] if c["name"] == container]
        found.append((name, engine, {v["name"]: v for v in spec["volumes"]}))
    return found


def test_engines_run_unprivileged_and_mount_no_shared_memory_of_the_daemon() -> None:
    for name, engine, volumes in _engine_mounts():
        for m in engine["volumeMounts"]:
            source = volumes[m["name"]]
            assert not source.get("hostPath", {}).get("path", "").startswith("/dev/shm"), name
            assert m["name"] != "shm", (name, m)  # the daemon's own emptyDir
        pod = _manifest(name)["spec"].get("securityContext", {})
        assert {**pod, **engine.get("securityContext", {})}.get("runAsNonRoot") is True, name
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    assert not compose["services"]["engine"]["user"].startswith("0")


def test_fresh_node_gets_a_socket_folder_the_daemon_can_use(sock_dir: Path, shm_dir: Path) -> None:
    spec = _manifest("daemonset.yaml")["spec"]["template"]["spec"]
    [prepare] = spec["initContainers"]
    user = f"{spec['containers'][0]['securityContext']['runAsUser']}:" + str(
        spec["containers"][0]["securityContext"]["runAsGroup"]
    )
    python = as_user(user)
    # What the kubelet makes of a missing hostPath, and a folder another user made first.
    sock_dir.chmod(0o755)  # stands for the node's /run
    run = sock_dir / "run"
    run.mkdir(mode=0o755)
    shm_dir.chmod(0o1777)
    (shm_dir / "engramd").mkdir()
    os.chown(shm_dir / "engramd", 65534, 65534)
    # The Secret as the kubelet mounts it without an fsGroup (root's, defaultMode 0400), and
    # the emptyDir for the daemon's copy (0777, as the kubelet makes one).
    secret, copy = sock_dir / "secret", sock_dir / "peer"
    secret.mkdir(mode=0o755)
    (secret / "token").write_text("fleet-token-0123456789abcdef")
    (secret / "token").chmod(0o400)
    copy.mkdir()
    copy.chmod(0o777)
    # The image's `engramd` group is the daemon's own (runAsGroup): its own group here,
    # whatever groups this machine has.
    args = ["--socket-group", "", "--peers", "127.0.0.1:1", "--peer-token-file", f"{copy}/token"]
    d = Daemon(run / "engramd.sock", shm_dir, args, sock_dir / "daemon.log", python=python)
    with pytest.raises(RuntimeError, match="exited with 1"):
        d.start()
    script = prepare["command"][-1].replace("/run/engramd", str(run))
    script = script.replace("/dev/shm", str(shm_dir))
    script = script.replace("/run/secrets/engramd-peer", str(secret))
    script = script.replace("/etc/engramd/peer", str(copy))
    subprocess.run(["sh", "-c", script], check=True, capture_output=True)
    d.start()
    try:
        assert d.status().daemon.ready
        assert stat.S_IMODE(d.socket.stat().st_mode) == 0o660
        names = sorted(p.name.split("-")[0] for p in shm_dir.iterdir())
        assert names == ["engramd", "engramd.untrusted"]
        assert (shm_dir / "engramd").stat().st_uid == int(user.split(":")[0])
        # The daemon took its copy of the token: 990's alone.
        st = (copy / "token").stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (int(user.split(":")[0]), 0o400)
        assert stat.S_IMODE(copy.stat().st_mode) == 0o700
    finally:
        d.stop()


def test_daemonset_peers_agree_with_the_service_and_the_secret() -> None:
    """The peer port, the headless Service over it and the token Secret name one another."""
    template = _manifest("daemonset.yaml")["spec"]["template"]
    spec = template["spec"]
    [daemon] = spec["containers"]
    args = _args(daemon)
    service = _manifest("peers-service.yaml")
    secret = _manifest("peer-token-secret.yaml")
    host, _, port = args["peer-listen"].rpartition(":")
    assert host == "$(POD_IP)"
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    [peer] = service["spec"]["ports"]
    assert peer["port"] == int(port) == ports[peer["targetPort"]]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    name = service["metadata"]["name"]
    namespace = service["metadata"]["namespace"]
    assert args["peers"] == f"{name}.{namespace}.svc.cluster.local:{port}"
    volumes = {v["name"]: v for v in spec["volumes"]}
    token_dir, _, token_key = args["peer-token-file"].rpartition("/")
    # The daemon reads its own copy (a memory emptyDir), which prepare-node makes from the
    # Secret, 0400 in a 0700 folder: a Secret's files are root's, or 0440 with an fsGroup.
    mount = _mounts(daemon)[token_dir]
    assert volumes[mount]["emptyDir"]["medium"] == "Memory"
    assert "securityContext" not in spec or "fsGroup" not in spec["securityContext"]
    [prepare] = spec["initContainers"]
    prepared = {m["mountPath"]: m["name"] for m in prepare["volumeMounts"]}
    assert prepared[token_dir] == mount
    [secret_dir] = [p for p, n in prepared.items() if "secret" in volumes[n]]
    assert volumes[prepared[secret_dir]]["secret"]["secretName"] == secret["metadata"]["name"]
    assert volumes[prepared[secret_dir]]["secret"]["defaultMode"] == 0o400
    script = prepare["command"][-1]
    token = f"{token_dir}/{token_key}"
    assert f"cp {secret_dir}/{token_key} {token}" in script
    assert f"chmod 0400 {token}" in script and f"chmod 0700 {token_dir}" in script
    assert f"chown 990:990 {token}" in script
    assert token_key in secret["stringData"]
