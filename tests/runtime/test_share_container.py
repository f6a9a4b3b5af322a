"""Walkthrough: a share container (cores + memory) in a real container registers through its pod's
vcuda.sock from inside its own PID namespace, and reads back its own vcuda.config."""

from __future__ import annotations

from libs.cgroups import unified_only
from libs.kube.pods import RESOURCE_VCORE
from services.registrar.prestart import AHEAD_AFTER_S
from tests.runtime.helpers import (
    VCUDA_SOCK,
    RtNode,
    gpu_container,
    host_cgroup_of_pid1,
    pod,
    runtime_id,
)


async def test_share_container_registers_from_inside_and_reads_its_vcuda_config(rt_node: RtNode) -> None:
    node = rt_node
    ahead = node.services["vmanager"].registrations.ahead
    assert ahead is not None  # the runtime endpoint is set: the vmanager watches the pods' cgroups
    asked, used = ahead.asked, ahead.used
    # 1. A pod asking for half a GPU and 4 x 256 MiB starts as a real container.
    running = await node.run_pod(pod("share", gpu_container("cuda", cores=50, memory=4)))
    assert running["status"]["phase"] == "Running", running["status"]
    uid = running["metadata"]["uid"]
    cid = runtime_id(running, "cuda")

    # 2. Inside: the Allocate response's env, the read-only /etc/vcuda mount, its own PID namespace.
    code, out = await node.sh("share", "cuda", "echo $LD_LIBRARY_PATH; echo $$; ls /etc/vcuda; "
                              "grep ' /etc/vcuda ' /proc/self/mounts; cat /proc/self/cgroup")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "/usr/local/nvidia/lib64"
    assert int(lines[1]) < 100  # a pid of the container's namespace, not the host's
    assert "vcuda.sock" in lines[2:4]
    assert any(" /etc/vcuda " in line and "ro," in line for line in lines), out
    # The cgroup runc made, under the QoS parent. On cgroup v2 containerd gives the container a cgroup
    # namespace of its own, so from inside it is "/"; the host sees the real path.
    if unified_only():
        assert "0::/" in lines, out
        assert f"/kubepods/besteffort/pod{uid}/{cid}" in await host_cgroup_of_pid1(node, "share", "cuda")
    else:
        assert f"/kubepods/besteffort/pod{uid}/{cid}" in out

    # 3. Register the way the interception library does: connect to the mounted vcuda.sock.
    code, out = await node.register("share", "cuda")
    assert (code, out.strip()) == (0, "registered"), out
    # The vmanager named the container by asking containerd (CRI ContainerStatus), not the pod's status,
    # and it asked when runc made the container's cgroup, before the container ran: once, for the
    # container only (not for the sandbox, whose cgroup came first), and the registration used it.
    assert node.services["vmanager"].registrations.names.resolved == {"runtime": 1}
    assert (ahead.asked - asked, ahead.used - used) == (1, 1)

    # 4. The container reads its own vcuda.config: its pod, its container, 50 % and 1 GiB.
    cfg = await node.read_vcuda_config("share", "cuda")
    assert cfg.pod_uid == uid
    assert cfg.container_name == "cuda"
    assert cfg.utilization == 50
    assert cfg.gpu_memory == 4 * 256 * 1024 * 1024
    # The file is read-only from inside.
    code, out = await node.sh("share", "cuda", f"echo x > /etc/vcuda/{cid}/vcuda.config")
    assert code != 0 and "Read-only file system" in out, out
    assert VCUDA_SOCK.startswith("/etc/vcuda/")

    # 5. The library's whole first step as one process inside (what bench/pod_start.py's GPU container
    # runs): its ids from /proc/self/cgroup, the registration, its own 8240-byte vcuda.config read,
    # then its "running" file, created only once all of that succeeded.
    reply = await node.exec("share", "cuda", "/bin/vcuda-register", "--self", VCUDA_SOCK, "/tmp/ready")
    if unified_only():
        # Not on cgroup v2: inside its cgroup namespace the container's /proc/self/cgroup is "0::/",
        # so a library that finds its container there (vcuda-controller reads v1's `memory` line; this
        # client the kubepods path) cannot. Registration by an id given from outside (3.) is what works
        # there (docs/limit-delivery.md).
        assert (reply.exit_code, reply.stderr) == (2, b"no kubepods cgroup in /proc/self/cgroup\n"), reply
        return
    assert (reply.exit_code, reply.stdout, reply.stderr) == (0, b"", b""), reply
    code, out = await node.sh("share", "cuda", "test -e /tmp/ready && echo ready")
    assert (code, out.strip()) == (0, "ready"), out
    # Registered through a link elsewhere, it finds no vcuda.config beside it: a failure, not a silent
    # pass, and no "running" file.
    code, out = await node.sh("share", "cuda", "mkdir -p /tmp/x && ln -sf /etc/vcuda/vcuda.sock /tmp/x/vcuda.sock && "
                              "/bin/vcuda-register --self /tmp/x/vcuda.sock /tmp/x/ready; echo rc=$?")
    assert f"/tmp/x/{cid}/vcuda.config" in out and "rc=0" not in out, out
    code, out = await node.sh("share", "cuda", "ls /tmp/x")
    assert out.split() == ["vcuda.sock"], out


async def test_prestart_comes_after_the_pods_sandbox_as_in_the_kubelets_sync(rt_node: RtNode) -> None:
    """The kubelet's SyncPod creates the pod's sandbox, then builds each container's options
    (PreStartContainer among them) right before creating it: containerd's record of the sandbox is
    older than the simulated kubelet's PreStartContainer call."""
    import time

    node = rt_node
    running = await node.run_pod(pod("ordered", gpu_container("cuda", cores=20, memory=1)))
    assert running["status"]["phase"] == "Running", running["status"]
    wall_minus_mono = time.time() - time.monotonic()
    prestart = next(c for c in node.sim.calls if c.method == "PreStartContainer" and c.ok)
    sandbox = next(s for s in await node.client.list_pod_sandboxes()
                   if s.metadata.uid == running["metadata"]["uid"])
    assert sandbox.created_at / 1e9 < prestart.start + wall_minus_mono
    # The sandbox took longer than the registrar waits after an Allocate before asking the PreStart's
    # verdict itself (the allocator's check, the vmanager's socket): that verdict answered the
    # kubelet's PreStart, with no bus round trip while the kubelet waited.
    allocate = next(c for c in node.sim.calls if c.method == "Allocate" and c.resource == RESOURCE_VCORE and c.ok)
    assert allocate.end is not None
    [vcore] = [s.plugin for s in node.services["registrar"].kubelet.servers if s.plugin.resource == RESOURCE_VCORE]
    if prestart.start - allocate.end > AHEAD_AFTER_S:
        assert vcore.prestart.answered == {"ahead": 1}
    else:  # a sandbox quicker than that: the PreStart asked, as it always may
        assert vcore.prestart.answered == {"asked": 1}
