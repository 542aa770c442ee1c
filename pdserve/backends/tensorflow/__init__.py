"""TensorFlow backend (``platform: "tensorflow_savedmodel"``): SavedModel folders."""
