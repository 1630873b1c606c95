"""
The fleet: which engines exist (L{registry}, L{catalog}), their worker processes
(L{supervisor}, L{watchdog}) and which of their models are loaded (L{residency}).
"""
