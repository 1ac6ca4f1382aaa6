"""Side studies: each measures one question beside the ladder and returns rows and records.

``ablation`` (one setting at a time, with a noise bound), ``inductor`` (inductor's own knobs, as
ablation toggles), ``breakdown`` (where a step's time goes, against its floors), ``process_noise``
(a step again in fresh processes), ``data_wait`` (share of step time spent on data), ``shapes`` (what
padding a GEMM buys), ``bk_core`` (the ResNet-BK kernel grid), ``memory`` (memory techniques on a
ladder step), ``batch_finder`` (the largest batch that fits), ``generation`` (the Polychromic
trainer's generation ladder), ``decode_bench`` and ``decode_matvec`` (its decode step past rung d, and
the decode matmul's tile sweep), ``trainer_cycle`` (the trainer's cycle at every rung and model size),
``nli_anchor`` (transformers' BERT beside the NLI encoder), and ``kernel_records`` (the one row and record format of kernels timed
alone, which every step's study shares).

A step past the recipe keeps its own study in its folder (``hwlib/steps/sNN_name/study.py``: its op
against float64 and its kernels alone). Such a study is a runner like these, although its folder is
in the core: the core never imports it (tests/test_layers.py holds both).
"""
