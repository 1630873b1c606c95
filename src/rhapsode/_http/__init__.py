"""
The public port: the route table (L{table}), the site that admits each request at its
head (L{site}), the error envelopes (L{envelopes}), the HTTP sinks an utterance is
written to (L{sinks}) and the native routes (L{router}).
"""
