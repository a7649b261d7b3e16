"""The processes of a job: devices, the process group, what the ranks agree on, and faults.

dist.py         the process group, devices, collectives
store_waits.py  waits through the store, cut short by the ranks' heartbeats
faults.py       stop signals, the watchdog, step agreements, the exit path
"""
