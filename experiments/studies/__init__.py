"""The studies: one module per study, each with `run(config, workdir)`, its `CONFIG_RULES`
and `check_data(config)`; `config.study='levy_1d'` runs `experiments.studies.levy_1d`."""
