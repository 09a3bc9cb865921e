"""Training models larger than GPU memory on one GPU by streaming layers from host RAM.

fp32 masters and Adam moments stay in host RAM (:mod:`.host_state`); the offloaded step
(:mod:`.engine`) moves one layer at a time through two GPU slots on three lanes (:mod:`.lanes`);
the host optimizer (:mod:`.optimizer`) updates layer by layer behind the next step's forward.
:class:`TrainLoop` (:mod:`.runner`) runs a whole job: ``tandem train`` and ``tandem serve trainer``
use it. Presets: :mod:`.presets`; data: :mod:`.data`; checkpoints: :mod:`.checkpoint`.
"""
