"""Results: the HDF5 schema, writer, journal and reader; per-document scores, statistics, comparison and rendering."""
