"""Measuring a (target, draft) pair: acceptance, tau, the cost ratios, the real speedup and the predicted one.

One settings object (``settings.MeasureSettings``) says what a measurement runs: prompts, decoding
options, length, stop tokens, seed, repeats, batch size. The modules, from the bottom up:

- ``clock``: the device-aware clock the decoders time their phases with, and ``eval_mode``;
- ``theory``: the speedup predicted from alpha, gamma, c and v (chains and trees), alpha from tau;
- ``costs``: c and v from the decoders' stats, or c timed on its own (``measure_cost_ratio``);
- ``settings``: ``MeasureSettings``;
- ``tally``: tokens and seconds of one decoder over one repeat;
- ``runs``: the pair runner both timings share: batches, warm-up, repeats, the two decoders interleaved;
- ``pair``: ``evaluate_pair``, the bundled decoder beside the target alone;
- ``figures``: the report's figures from the tallies (medians over repeats, per category);
- ``tables``: plain-text tables and the spread of a figure over repeats;
- ``hf_compare``: ``transformers`` generate and assisted generation on stock copies, at the same gamma;
- ``vllm_pair`` and ``engine_compare``: the pair in vLLM, and beside the bundled decoder.

Nothing is imported here: the decoder imports ``clock`` and must not load the rest.
"""
