"""learn: the placement model (features, training, evaluation, simulation). Importing this package alone is cheap;
scikit-learn comes in with hostagent.learn.model, so an agent with no trained model never loads it."""

MODEL_KIND = "placement"  # the usage store's kind of model version this package trains and loads
