"""Which requests arrive when: arrivals, prompt and output lengths, shared prefixes, recorded
closed-loop runs to replay, and multi-turn sessions. The same requests feed the simulator and
the live client."""
