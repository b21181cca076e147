"""dlcp.testbed: an emulated cluster in network namespaces (needs root).

One namespace per host, a switch namespace with a Linux bridge per path, veth
pairs between them; the switch ports get dlcp.tc's HTB priority plan at the
link rate, nftables random loss, and iperf3 background traffic on demand.
`Testbed.up(spec)` builds one, `Testbed.attach(name)` finds one built by another
process, `down(name)` removes one. The CLI is `dlcp testbed`.
"""

from dlcp.testbed.plan import TestbedError, TestbedSpec
from dlcp.testbed.testbed import DEFAULT_DAEMON_COMMAND, Host, Testbed, down

__all__ = ["DEFAULT_DAEMON_COMMAND", "Host", "Testbed", "TestbedError", "TestbedSpec", "down"]
