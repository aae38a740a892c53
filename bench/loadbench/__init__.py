"""The load benchmark behind ``bench/load_bench.py``, one job per module:

- ``common``: units, the benchmark's error, /proc readers shared by the others;
- ``shapes``: the synthetic Llama shape, its presets and the adapters it is loaded with;
- ``models``: the model skeleton on meta, its parallelisation, materialisation with values;
- ``checkpoint``: fit check, writing the checkpoint in every format, page-cache warming;
- ``twins``: the quantized twins other tools write (compressed-tensors int4/int8/FP8/MXFP8,
  per-tensor FP8, ModelOpt NVFP4) and each format's reference decompression;
- ``memory``: RSS sampling and read counters inside a worker;
- ``paths``: the load paths compared, their timed load and the bit-exact check;
- ``references``: the machine's own read and copy rates, measured in the same run;
- ``worker``: one worker process (one rank of one fresh process group);
- ``launch``: starting and timing out one fresh process group;
- ``report``: per-path rows and the markdown table;
- ``cli``: the command line and the run as a whole.
"""
