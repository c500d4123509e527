"""Questions answered over many runs: the safe request rate under an SLO, the speculative
decoding crossover, what-if sweeps, the fewest replicas for a rate, and their figures."""
