"""What the small studies share: the models table, the Keras training protocol, the report
writer (results.json/csv/md and claims) and the figure helpers."""
