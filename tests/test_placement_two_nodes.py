"""Two emulated nodes (network namespaces + a rate-limited veth): detection and placement.

The ranks are started by torchrun's multi-node c10d rendezvous, two per namespace; detection
must find 2 nodes x 2 ranks and ``ok.plan(tp=2)`` must keep each tp pair inside its node.
Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

import subprocess

import pytest

from bench.harness.two_nodes import TwoNodes, unavailable_reason
from bench.placement import launch, parse_args

REASON = unavailable_reason()
needs_namespaces = pytest.mark.skipif(REASON is not None, reason=f"ip netns: {REASON}")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_namespaces
def test_namespaces_a_killed_run_left_are_removed_by_the_next_run():
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = [f"ovk{dead.pid}a", f"ovk{dead.pid}b"]
    for name in left:
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        with TwoNodes(rate="1gbit"):
            assert not any(name in _namespaces().split() for name in left)
    finally:
        for name in left:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@needs_namespaces
def test_namespaces_and_link_are_removed_even_when_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"), TwoNodes(rate="1gbit") as nodes:
        names = [node.namespace for node in nodes.nodes]
        assert all(name in _namespaces() for name in names)
        qdisc = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                names[0],
                "tc",
                "qdisc",
                "show",
                "dev",
                nodes.nodes[0].interface,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc
        raise RuntimeError("boom")
    left = _namespaces()
    assert not any(name in left for name in names)
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert nodes.nodes[0].interface not in links


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_detection_finds_two_nodes_of_two_ranks_and_tp_stays_in_each_node():
    report = launch(parse_args(["--detect-only", "--timeout", "200"]))
    assert report["world_size"] == 4
    assert report["nodes"] == [[0, 1], [2, 3]]
    assert report["detected_tp_groups"] == report["nodes"]
    assert report["detected_dp_groups"] == [[0, 2], [1, 3]]
