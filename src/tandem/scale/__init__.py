"""Sync at scale: plan a fleet update from metadata alone, count the bytes on every link of a
cluster, and predict its time with a bucket-level schedule simulation."""

from tandem.scale.cluster import Cluster
from tandem.scale.layouts import FleetSpec, TrainerSpec
from tandem.scale.predict import SyncPrediction, predict_sync

__all__ = ["Cluster", "FleetSpec", "SyncPrediction", "TrainerSpec", "predict_sync"]
