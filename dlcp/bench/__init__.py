"""dlcp.bench: dlcp against Gloo on the emulated cluster (`dlcp bench ...`, `dlcp demo`).

- `common`: sizes, rates, percentiles, the JSON records (DESIGN.md "Public surfaces");
- `backends`: the one table of `--backends` names and how each runs (dlcp,
  Gloo and PyTorch's fp16/bf16/PowerSGD hooks, -prio variants, ablations);
  `hooks`: those hooks as the workers register them;
- `fair`: the baseline a dlcp record is judged against (the fastest of its
  invocation whose accuracy is no worse);
- `cluster`: a benchmark's testbed, its scenario (loss, bursts, background
  traffic), Gloo's DSCP marking (gloo-prio) and dlcp's daemons per backend;
- `allreduce`, `train`, `ddp` (`ddp_cli`), `suite`: `dlcp bench allreduce|train|ddp|all`;
- `ar_worker`, `train_worker`, `ddp_worker`: the processes in the hosts' namespaces;
- `plots`, `report`, `scorecard`, `codec_table`, `report_cli`: PNG plots,
  markdown tables and the issues' targets (`dlcp bench report`).

Needs root to run (network namespaces); everything but the runs themselves
(parsing, records, plots, reports) works without.
"""
