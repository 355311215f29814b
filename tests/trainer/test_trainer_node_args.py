"""The trainer's node flags: checked at parse time, and the torchrun command they give."""

from __future__ import annotations

import pytest

from everstep_trainer.__main__ import parse_args, torchrun_command


def _torchrun_flags(argv: list[str]) -> list[str]:
    command = torchrun_command(parse_args(argv))
    return command[command.index("torch.distributed.run") + 1:command.index("everstep_trainer") - 1]


def test_one_node_is_a_standalone_rendezvous() -> None:
    assert _torchrun_flags(["--nproc-per-node", "4"]) == ["--standalone", "--nproc-per-node=4"]


def test_several_nodes_meet_at_node_0() -> None:
    assert _torchrun_flags(["--nnodes", "3", "--node-rank", "2", "--master-addr", "trainer-0.ml.svc",
                            "--master-port", "29600", "--nproc-per-node", "8"]) == [
        "--nnodes=3", "--node-rank=2", "--master-addr=trainer-0.ml.svc", "--master-port=29600", "--nproc-per-node=8"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--nnodes", "0"], "--nnodes: must be >= 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "--node-rank: must be in 0..1"),
    (["--nnodes", "2", "--node-rank", "1"], "--master-addr: required with --nnodes > 1"),
])
def test_node_flags_are_refused_with_the_flag_to_change(argv: list[str], message: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
