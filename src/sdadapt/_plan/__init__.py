"""Floor 4, planning: an adapter (an ordered list of rules) applied to a source schema and a
target schema gives a plan (target key -> recipe) and a report. Also here: which adapter a name,
a model or a spec means (shipped adapters, transformers' conversion mapping, torchtitan's names)."""
