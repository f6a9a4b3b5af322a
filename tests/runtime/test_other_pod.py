"""Walkthrough: a container of another pod that gets the first pod's vcuda.sock bind-mounted (a
hostPath volume) cannot register through it: the socket checks the caller's cgroup, not its path."""

from __future__ import annotations

from pathlib import Path

from tests.runtime.helpers import RtNode, gpu_container, pod


async def test_another_pods_container_is_refused_on_the_first_pods_socket(rt_node: RtNode) -> None:
    node = rt_node
    first = await node.run_pod(pod("owner", gpu_container("cuda", cores=50, memory=2)))
    assert first["status"]["phase"] == "Running", first["status"]
    first_dir = Path(node.settings.vm_root) / first["metadata"]["uid"]

    intruder = pod("intruder", gpu_container("cuda", cores=10, memory=1))
    intruder["spec"]["volumes"] = [{"name": "stolen", "hostPath": {"path": str(first_dir)}}]
    intruder["spec"]["containers"][0]["volumeMounts"] = [{"name": "stolen", "mountPath": "/stolen"}]
    second = await node.run_pod(intruder)
    assert second["status"]["phase"] == "Running", second["status"]

    code, out = await node.sh("intruder", "cuda", "ls /stolen/vcuda.sock")
    assert code == 0, out  # it does reach the socket file
    reply = await node.exec("intruder", "cuda", "/bin/vcuda-register", "/stolen/vcuda.sock",
                            first["metadata"]["uid"], "0" * 64)
    out = (reply.stdout + reply.stderr).decode()
    assert reply.exit_code == 1 and "grpc-status 7" in out, out  # PERMISSION_DENIED
    # The owner still registers through its own mount.
    code, out = await node.register("owner", "cuda")
    assert code == 0, out
