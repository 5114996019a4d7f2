"""MindSpore's msMonitor hook, provided by ms-monitor (``MSMONITOR_USE_DAEMON=1``).

MindSpore 2.10 imports ``IPCMonitor.PyDynamicMonitorProxy`` when that variable is set; this module
hands it ms-monitor's implementation (see ``ms_monitor.dyno``), which talks to ``ms-monitor daemon``.
It takes the place of Ascend's ``msmonitor_plugin`` wheel: install one or the other.
"""

from ms_monitor.dyno import PyDynamicMonitorProxy, install_rank_gate

# MindSpore only imports this module in the rank that forks the node's config poller; a script
# that imports it itself makes its own rank honour ``ms-monitor trace --ranks`` too.
install_rank_gate()

__all__ = ["PyDynamicMonitorProxy"]
