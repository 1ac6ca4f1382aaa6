"""Everything a person reads of a run, derived from its results through ``hwlib.query``: tables,
figures, summary.json and the README's reference section. Nothing here is typed by hand."""
