"""The vision trainer (`config.study` absent or `'train'`): its models, input pipeline,
sharding over devices and hosts, checkpoints, and the curve plotter."""
