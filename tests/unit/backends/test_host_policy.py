"""Host policies: ``--host-policy`` parsing and checks, default policy names, the
instance group check, and ORT's intra-op affinity string."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pdserve.app.cli import build_parser
from pdserve.app.settings import Settings
from pdserve.backends import host_policy as hp
from pdserve.backends.onnxruntime.backend import (
    default_intra_op_threads,
    intra_op_affinities,
)

ALLOWED = frozenset({0, 1, 2, 3, 4, 5, 6, 7})


@pytest.fixture
def numa_root(tmp_path: Path) -> Path:
    """A fake ``/sys/devices/system/node`` with node0 = 0-3 and node1 = 4-7."""
    for node, cpus in (("node0", "0-3"), ("node1", "4-7")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", {0}),
        ("0-3", {0, 1, 2, 3}),
        ("0-3,5", {0, 1, 2, 3, 5}),
        ("1-1", {1}),  # Triton's own spelling of one core
        (" 2 , 4-5 ", {2, 4, 5}),
    ],
)
def test_parse_cpu_list(text: str, expected: set[int]) -> None:
    assert hp.parse_cpu_list(text) == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a", "'a' is not a core id"),
        ("0,,1", "'' is not a core id"),
        ("3-1", "'3-1' is not a valid range"),
        ("-1", "'-1' is not a core id"),
        ("0-", "'0-' is not a core id"),
        # int() would take these: "+1" as 1, "1_0" as 10, Arabic-Indic zero as 0
        ("+1", "'+1' is not a core id"),
        ("1_0", "'1_0' is not a core id"),
        ("\u0660", "'\u0660' is not a core id"),
        ("0-+1", "'0-+1' is not a core id"),
    ],
)
def test_parse_cpu_list_errors(text: str, needle: str) -> None:
    with pytest.raises(hp.HostPolicyError, match=re.escape(f"'cpu-cores' value '{text}'")) as e:
        hp.parse_cpu_list(text)
    assert needle in str(e.value)


@pytest.mark.parametrize("text", ["0-99999999999", "99999999999", "65536", "0-65536,1"])
def test_parse_cpu_list_huge_ids_refused_without_expanding(text: str) -> None:
    # each used to be expanded into a set of every id up to it (gigabytes, minutes)
    with pytest.raises(hp.HostPolicyError, match="the highest core id accepted") as e:
        hp.parse_cpu_list(text)
    assert f"goes past {hp.MAX_CPU_ID}" in str(e.value)


def test_parse_cpu_list_highest_id() -> None:
    assert hp.parse_cpu_list(f"{hp.MAX_CPU_ID}") == {hp.MAX_CPU_ID}


def test_format_cpu_list() -> None:
    assert hp.format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert hp.format_cpu_list({1}) == "1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu,cpu-cores=0-3", ("cpu", "cpu-cores", "0-3")),
        ("gpu_0,numa-node=0", ("gpu_0", "numa-node", "0")),
        ("fast,cpu-cores=0-3,5", ("fast", "cpu-cores", "0-3,5")),
    ],
)
def test_parse_option(text: str, expected: tuple[str, str, str]) -> None:
    assert hp.parse_option(text) == expected


@pytest.mark.parametrize(
    "text", ["cpu", "cpu,cpu-cores", ",cpu-cores=1", "cpu,=1", "cpu,cpu-cores="]
)
def test_parse_option_format_errors(text: str) -> None:
    with pytest.raises(hp.HostPolicyError) as e:
        hp.parse_option(text)
    # Triton's wording (tritonserver's ParseHostPolicyOption)
    assert str(e.value) == (
        f"--host-policy option format is '<policy name>,<setting>=<value>'. Got {text}"
    )


def test_parse_option_unknown_setting() -> None:
    with pytest.raises(hp.HostPolicyError) as e:
        hp.parse_option("cpu,cores=1")
    assert str(e.value) == (
        "Unsupported host policy setting 'cores' is specified, supported settings are "
        "'numa-node', 'cpu-cores'"
    )


def test_resolve_policies_merge_numa_and_cores(numa_root: Path) -> None:
    policies = hp.resolve_policies(
        [
            "a,cpu-cores=0-5",
            "a,numa-node=1",  # same policy: intersection with node1 (4-7)
            "b,numa-node=0",
            "c,cpu-cores=7",
            "c,cpu-cores=6",  # a later value of a setting replaces the earlier one
        ],
        ALLOWED,
        numa_root,
    )
    assert policies == {"a": {4, 5}, "b": {0, 1, 2, 3}, "c": {6}}


def test_numa_node_limited_to_allowed_cpus(numa_root: Path) -> None:
    assert hp.resolve_policy("a", {"numa-node": "1"}, {0, 1, 4}, numa_root) == {4}
    with pytest.raises(hp.HostPolicyError, match="NUMA node 1 has none of the CPUs"):
        hp.resolve_policy("a", {"numa-node": "1"}, {0, 1}, numa_root)


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"cpu-cores": "6-9"}, "host policy 'p': cpu-cores 8-9 not available to this process"),
        ({"numa-node": "2"}, "host policy 'p': NUMA node 2 does not exist"),
        ({"numa-node": "x"}, "'numa-node' value 'x' is not a NUMA node id"),
        ({"cpu-cores": "0-1", "numa-node": "1"}, "cpu-cores 0-1 are not on NUMA node 1"),
    ],
)
def test_resolve_policy_errors(numa_root: Path, settings: dict[str, str], needle: str) -> None:
    with pytest.raises(hp.HostPolicyError) as e:
        hp.resolve_policy("p", settings, ALLOWED, numa_root)
    assert needle in str(e.value)


def test_real_numa_node_zero_exists_here() -> None:
    if not (hp.NUMA_ROOT / "node0" / "cpulist").exists():
        pytest.skip("no NUMA information in /sys on this machine")
    assert hp.resolve_policy("p", {"numa-node": "0"}) <= hp.allowed_cpus()


# -- the command line ---------------------------------------------------------------


def test_cli_collects_policies() -> None:
    core = min(os.sched_getaffinity(0))
    args = build_parser().parse_args(
        ["serve", "--host-policy", f"cpu,cpu-cores={core}", "--host-policy", f"x,cpu-cores={core}"]
    )
    assert args.host_policy == {"cpu": {"cpu-cores": str(core)}, "x": {"cpu-cores": str(core)}}
    assert Settings(host_policy=args.host_policy).host_policies() == {"cpu": {core}, "x": {core}}
    assert Settings().host_policies() == {}


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("cpu", "--host-policy option format is '<policy name>,<setting>=<value>'. Got cpu"),
        ("cpu,memory=1", "Unsupported host policy setting 'memory'"),
        ("cpu,cpu-cores=4096", "cpu-cores 4096 not available to this process"),
        ("cpu,numa-node=999", "NUMA node 999 does not exist"),
        ("cpu,cpu-cores=2-1", "'2-1' is not a valid range"),
        # a huge range is refused at once (it used to build a set of 10^11 ids)
        ("cpu,cpu-cores=0-99999999999", "host policy 'cpu': 'cpu-cores' value '0-99999999999'"),
        ("cpu,cpu-cores=1_0", "host policy 'cpu': 'cpu-cores' value '1_0': '1_0' is not a"),
    ],
)
def test_cli_bad_host_policy_exits_2(value: str, needle: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", "--host-policy", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pdserve serve: error: argument --host-policy:" in proc.stderr
    assert needle in proc.stderr


def test_cli_help_documents_host_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--host-policy NAME,SETTING=VALUE" in out
    assert "cpu-cores" in out and "numa-node" in out and "memory is not bound" in out


# -- instance groups ------------------------------------------------------------------


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def test_default_policy_names() -> None:
    cfg = _config(
        'instance_group [{ name: "c", kind: KIND_CPU }, { name: "g", kind: KIND_GPU, gpus: [0, 2] },'
        ' { name: "m", kind: KIND_MODEL }, { name: "n", kind: KIND_CPU, host_policy: "numa1" }]'
    )
    cpu, gpu, model, named = cfg.instance_group
    assert hp.policy_name(cpu) == "cpu"
    assert [hp.policy_name(gpu, d) for d in gpu.gpus] == ["gpu_0", "gpu_2"]
    assert hp.policy_name(model) == "model"
    assert hp.policy_name(named) == "numa1"
    policies = {"cpu": frozenset({1}), "gpu_2": frozenset({0})}
    assert hp.instance_cores(policies, cpu) == {1}
    assert hp.instance_cores(policies, gpu, 0) is None
    assert hp.instance_cores(policies, gpu, 2) == {0}
    assert hp.instance_cores({}, cpu) is None


def test_check_instance_groups() -> None:
    cfg = _config(
        'instance_group [{ name: "ok", kind: KIND_CPU, host_policy: "cpu" },'
        ' { name: "g", kind: KIND_GPU, gpus: [1], host_policy: "gpu_1" },'
        ' { name: "pinned", kind: KIND_CPU, host_policy: "numa1" }]'
    )
    # default names of the group's own kind need no --host-policy
    defaults = mc.ModelConfig()
    defaults.instance_group.extend(cfg.instance_group[:2])
    hp.check_instance_groups("m", defaults, {})
    with pytest.raises(hp.HostPolicyError) as e:
        hp.check_instance_groups("m", cfg, {"cpu": frozenset({0})})
    message = str(e.value)
    assert "model 'm' instance group 'pinned' names host policy 'numa1'" in message
    assert "which was not given" in message and "policies given: cpu" in message
    hp.check_instance_groups("m", cfg, {"numa1": frozenset({0})})
    wrong_kind = _config('instance_group [{ name: "x", kind: KIND_CPU, host_policy: "gpu_0" }]')
    with pytest.raises(hp.HostPolicyError, match="'x' names host policy 'gpu_0'"):
        hp.check_instance_groups("m", wrong_kind, {})


def test_check_instance_groups_gpu_group_without_gpus() -> None:
    # on a machine without GPUs the defaults leave `gpus` empty and the backends use
    # GPU 0: naming gpu_0 is the group's own default (its load then fails on the
    # missing GPU, not on a "policy not given" error); gpu_1 is not
    own = _config('instance_group [{ name: "g", kind: KIND_GPU, host_policy: "gpu_0" }]')
    hp.check_instance_groups("m", own, {})
    other = _config('instance_group [{ name: "g", kind: KIND_GPU, host_policy: "gpu_1" }]')
    with pytest.raises(hp.HostPolicyError, match="'g' names host policy 'gpu_1'"):
        hp.check_instance_groups("m", other, {})


# -- ONNX Runtime -------------------------------------------------------------------


def test_intra_op_affinities_format() -> None:
    # one entry per pool thread (threads - 1), ';'-separated, processor ids 1-based
    assert intra_op_affinities({1}, 1) == ""
    assert intra_op_affinities({1}, 3) == "2;2"
    assert intra_op_affinities({0, 2}, 2) == "1,3"


def test_default_intra_op_threads_counts_policy_cores() -> None:
    assert default_intra_op_threads(2, frozenset({4, 5, 6, 7})) == 2
    assert default_intra_op_threads(2, frozenset({1})) == 1
    assert default_intra_op_threads(1) == len(os.sched_getaffinity(0))


# -- pinning --------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_refused_names_the_cores() -> None:
    # a core this process may not use (a cpuset that shrank since the server started)
    outside = max(hp.allowed_cpus()) + 1
    with pytest.raises(hp.HostPolicyError) as e:
        hp.pin(0, {outside})
    assert f"cannot pin to host policy cpu-cores {outside}: " in str(e.value)
    assert f"may use cpu-cores {hp.format_cpu_list(hp.allowed_cpus())} now" in str(e.value)
    with pytest.raises(ProcessLookupError):  # a process that already exited
        hp.pin(2**22 + 12345, hp.allowed_cpus())
