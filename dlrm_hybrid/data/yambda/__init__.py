"""Yambda (Yandex Music's public log): its parquet layout, a generator of logs shaped like it,
and `preprocess yambda` into a ranking dataset with histories."""
