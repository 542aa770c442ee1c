"""The FIL backend: tree models (XGBoost, LightGBM, Treelite checkpoints) as Triton's FIL backend serves them."""
