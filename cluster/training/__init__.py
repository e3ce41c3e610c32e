"""Training a DFlash drafter for a target by self-distillation
(``specray train-drafter``; ``specray.training.cli`` has the recipe).

    prompts.py      the chat prompts: files, Magpie prefixes, held-out sets
    generator.py    static-batch, CUDA-graphed generation on specray's target worker
    selfdistill.py  the data: the target writes the answers (OUT/data.pt)
    dataset.py      usable sequences, tapped features, resumable batch order
    model.py        the drafter as trained (the DFlash authors' parameter names)
    initialize.py   fresh drafters from the target's layers, growing a checkpoint
    loss.py         the block loss and its acceptance statistics
    trainer.py      the loop: schedule, validation, saves
    resume.py       the training state that --resume continues from
    export.py       the checkpoint in the DFlash authors' format
    evaluate.py     acceptance through specray itself
    run.py, cli.py  one run start to finish; its command line

Why not SpecForge or vLLM's speculators (both train DFlash drafters): they
take their hidden states from a running SGLang / vLLM server (or from data
that server wrote), their data recipes read hub datasets, and their
checkpoints need converting to the authors' layout. This needs only torch +
transformers, generates its data with specray's own engine code (so it is
exactly what specray's greedy decoding emits), and writes the authors'
format, tested against their forward (tests/test_train_drafter.py).
"""
