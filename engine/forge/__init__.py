"""The forge: train an EAGLE-3 head for a target on the machine at hand, within a time budget, in the layout every
engine serves. It uses the engine (models, prompt sets, heads, bench); nothing in the engine uses it.

    pipeline the pipeline: prompts and their held-out split, data, vocabulary, training, export, "does it pay";
             ForgeConfig in, ForgeEvents out (forge_events), or the summary at the end (forge)
    data     the target's own answers in left-padded batches, with hidden states and top-k soft labels, as shards
    bank     general prompts beside the given ones (presets/forge_bank.json), so a head learns the target itself
    train    draft vocabulary, the head's starting weights, the train-time-test forward and its loss
    loop     the training loop: time-based schedule, validation, best state, checkpoints to resume from
    machine  threads and bfloat16 chosen by timing this machine
    export   the speculators layout, the recommended gamma, the model card
    pays     the head against prompt lookup, suffix and the target alone on the held-out prompts
    misses   where a head misses: first-draft hits by the target's confidence, validation answers against a prompt set
"""

from engine import exports

BANKS = ("workload", "even")  # ForgeConfig.bank: the general prompts' kinds by the given prompts' categories, or not
DATA_DTYPES = ("target", "bfloat16", "float16")  # ForgeConfig.data_dtype: the target's own, or a 16-bit copy of it

__all__ = ["BANKS", "DATA_DTYPES", "ForgeConfig", "ForgeEvent", "forge", "forge_events"]
__getattr__ = exports(__name__, {
    "ForgeConfig": "pipeline", "ForgeEvent": "pipeline", "forge": "pipeline", "forge_events": "pipeline",
})  # fmt: skip
