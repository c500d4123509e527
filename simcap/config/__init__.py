"""What a run is: the scenario (engine flags, step time, workload, SLO, seed) loaded from YAML,
the fitted profiles it draws on, and the public trace files a workload may replay. Validated
once, here; every layer above reads these models."""
