"""dlcp.bench: dlcp against Gloo on the emulated cluster (`dlcp bench ...`, `dlcp demo`).

- `common`: sizes, rates, percentiles, the JSON records (DESIGN.md "Public surfaces");
- `cluster`: a benchmark's testbed, its scenario (loss, bursts, background
  traffic), Gloo's DSCP marking (gloo-prio) and dlcp's daemons per backend;
- `allreduce`, `train`, `suite`: `dlcp bench allreduce|train|all`;
- `ar_worker`, `train_worker`: the processes that run in the hosts' namespaces;
- `plots`, `report`: PNG plots, markdown tables and the issue's targets.

Needs root to run (network namespaces); everything but the runs themselves
(parsing, records, plots, reports) works without.
"""
