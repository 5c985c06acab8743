"""The forge: train a draft head (EAGLE-3 or DFlash) for a target on the machine at hand, within a time budget, in
the layout every engine serves. It uses the engine (models, prompt sets, heads, bench); nothing in the engine uses it.

    pipeline   the phases: load, data, vocabulary, training, export, "does it pay"; ForgeConfig in, ForgeEvents out
               (forge_events)
    foreground the forge run from a waiting thread (the CLI's), its Ctrl-C: the summary at the end (forge)
    budget     the time budget and the plan that cuts it into the phases' seconds
    prompts    the given prompts split into train, validation and held out
    questions  what the target is asked for the data, in order: the prompts, general ones, follow-ups, its own
    data       the target's own answers in left-padded batches, with hidden states and top-k soft labels, as shards
    bank       general prompts beside the given ones (presets/forge_bank.json), so a head learns the target itself
    train      draft vocabulary, the EAGLE-3 head's starting weights, the train-time-test forward and its loss
    blocks     the DFlash head's starting weights, its anchored-block training forward and its loss
    loop       the training loop: time-based schedule, validation, best state, checkpoints to resume from
    machine    threads and bfloat16 chosen by timing this machine
    export     the speculators layout, the recommended gamma, the model card
    pays       the head against prompt lookup, suffix and the target alone on the held-out prompts
    misses     where a head misses: first-draft hits by the target's confidence, validation answers against a prompt set
"""

from engine import exports

BANKS = ("workload", "even")  # ForgeConfig.bank: the general prompts' kinds by the given prompts' categories, or not
DATA_DTYPES = ("target", "bfloat16", "float16")  # ForgeConfig.data_dtype: the target's own, or a 16-bit copy of it
KINDS = ("eagle3", "dflash")  # ForgeConfig.kind: the heads the forge makes

__all__ = ["BANKS", "DATA_DTYPES", "KINDS", "ForgeConfig", "ForgeEvent", "forge", "forge_events"]
__getattr__ = exports(__name__, {
    "ForgeConfig": "pipeline", "ForgeEvent": "pipeline", "forge": "foreground", "forge_events": "pipeline",
})  # fmt: skip
