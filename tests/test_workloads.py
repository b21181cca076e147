"""`dlcp bench train --model`: the workloads build offline, train, and their
targets and time to target are what `--help` says."""

from __future__ import annotations

import pytest
import torch

from dlcp.bench import workloads
from dlcp.bench.cluster import Setup
from dlcp.bench.common import BenchError
from dlcp.bench.train import TrainOptions, time_to_target
from tests.test_bench import parser


@pytest.mark.parametrize(
    ("name", "params", "shape"), [("cnn", 619_786, (4, 10)), ("gpt", 834_304, (4, 64, 256))]
)
def test_each_model_builds_offline_and_learns_a_few_steps(
    name: str, params: int, shape: tuple[int, ...]
) -> None:
    model, data = workloads.build(name, rank=1, world=3, seed=0, hidden=[])
    assert sum(p.numel() for p in model.parameters()) == params
    gen = torch.Generator().manual_seed(0)
    x, y = data.batch(4, gen)
    assert tuple(model(x).shape) == shape
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = data.batch(16, gen)
    first = float(workloads.loss_of(model(x), y).detach())
    for _ in range(8):  # the same batch: the loss must fall
        opt.zero_grad()
        workloads.loss_of(model(x), y).backward()
        opt.step()
    assert float(workloads.loss_of(model(x), y).detach()) < first
    acc, loss = data.evaluate(model)
    assert 0.0 <= acc <= 1.0 and loss > 0


def test_the_text_is_the_standard_librarys_own_sources() -> None:
    text = workloads.stdlib_text()
    assert len(text) == workloads.TEXT_BYTES
    assert b"def " in text and b"import " in text
    assert workloads.stdlib_text() == text  # the same bytes every time


def test_targets_and_time_to_target_follow_the_models_metric() -> None:
    setup = Setup(hosts=3)
    cnn = TrainOptions(setup=setup, model="cnn")
    gpt = TrainOptions(setup=setup, model="gpt")
    assert (cnn.metric, cnn.target, cnn.per_rank_batch) == ("acc", 0.95, 32)
    assert (gpt.metric, gpt.target, gpt.per_rank_batch) == ("val_loss", 3.0, 4)
    acc = [[0.0, 0.1], [5.0, 0.96]]
    loss = [[0.0, 5.5], [5.0, 3.2], [9.0, 2.9]]
    assert time_to_target(cnn, acc, loss) == 5.0
    assert time_to_target(gpt, acc, loss) == 9.0
    assert TrainOptions(setup=setup, model="gpt", target_acc=2.5).target == 2.5
    with pytest.raises(BenchError):
        TrainOptions(setup=setup, model="cnn", target_acc=2.5)
    assert cnn.overlaps("dlcp") is False
    on = TrainOptions(setup=setup, model="cnn", overlap=True)
    assert on.overlaps("dlcp") and not on.overlaps("dlcp-nooverlap") and not on.overlaps("gloo")


def test_the_cli_takes_model_overlap_and_target() -> None:
    args = parser().parse_args(
        ["bench", "train", "--model", "gpt", "--overlap", "on", "--target", "2.8",
         "--backends", "dlcp,dlcp-nooverlap,gloo"]
    )  # fmt: skip
    assert (args.model, args.overlap, args.target_acc) == ("gpt", "on", 2.8)
    assert args.backends == ["dlcp", "dlcp-nooverlap", "gloo"]
