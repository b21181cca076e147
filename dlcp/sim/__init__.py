"""`dlcp simulate`: the real protocol engines in a packet-level network, in virtual time.

Parts, one thing a module:
- `events`: the event heap and virtual clock;
- `port`: an egress port (eight strict-priority classes, pfifo limits, line
  rate in wire bytes, random loss, a link down);
- `fabric`: the topology (one switch, or leaf-spine with ECMP by flow hash)
  built of ports, and the routes through it;
- `host`: one dlcp daemon as `dlcp.daemon` drives its engine and outbox;
- `tcp`, `ring`: the baseline, ring all-reduce over a TCP model;
- `workload`, `scenario`, `run`: rounds and DDP steps, loss and bursts,
  the runs and their bench records; `cli`: the command.
"""

from __future__ import annotations

__all__: list[str] = []
