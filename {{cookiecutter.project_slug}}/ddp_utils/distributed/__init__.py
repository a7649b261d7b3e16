"""The processes of a job: devices, the process group, what the ranks agree on, and faults.

device.py         which device this process trains on, and why not a GPU when none can be used
process_group.py  the process group: which ranks, on which nodes, joined how
collectives.py    what the ranks agree on without making the host wait for the device
store_waits.py    waits through the store, cut short by the ranks' heartbeats
faults.py         stop signals, the watchdog, step agreements, the exit path
"""
