"""The vision tower (reserved): glm53 is the text model today; checkpoints' `model.visual.*` keys are skipped on
load and kept by the crop tool. No code yet."""
