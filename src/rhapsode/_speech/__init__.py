"""
Speech: one utterance from a checked body to the client, whichever door it came in by.
The service (L{service}) checks it (L{preflight}), the limits (L{limits}) give it a turn
and room, the relay (L{relay}) speaks it through its worker into the door's sink
(L{inprocess} is the one in memory), and L{metrics} measures it.  L{translate} reads
OpenAI's request fields as the native ones, for every door that takes them.
"""
