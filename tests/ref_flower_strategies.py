"""A transcription of Flower's server optimizers (flwr 1.42, adap/flower framework/py/flwr/server/strategy/:
aggregate.py `aggregate`, fedavgm.py `FedAvgM.aggregate_fit`, fedopt.py `FedOpt.__init__`, fedadam.py, fedyogi.py,
fedadagrad.py `aggregate_fit`), written from that code in plain numpy so the tests need no flwr. Each strategy keeps
its state as the Flower object does; `aggregate_fit(server_round, results)` takes flwr's 1-based round and the
results as (list of arrays, num_examples) and returns the new global arrays. Failures, metrics and the Parameters
codec are left out (they do not touch the arrays).

`BROKEN` holds copies broken on purpose, one slip each, for the negative controls."""

from __future__ import annotations

from functools import reduce

import numpy as np


def aggregate(results):
    """aggregate.py `aggregate`: the num_examples-weighted average, layer by layer."""
    num_examples_total = sum(num_examples for (_, num_examples) in results)
    weighted_weights = [[layer * num_examples for layer in weights] for weights, num_examples in results]
    return [reduce(np.add, layer_updates) / num_examples_total for layer_updates in zip(*weighted_weights)]


class FedAvgM:
    """fedavgm.py: server_learning_rate=1.0, server_momentum=0.0 by default; initial_parameters required."""

    def __init__(self, initial_parameters, server_learning_rate=1.0, server_momentum=0.0):
        self.initial_parameters = [np.array(a) for a in initial_parameters]
        self.server_learning_rate = server_learning_rate
        self.server_momentum = server_momentum
        self.server_opt = (self.server_momentum != 0.0) or (self.server_learning_rate != 1.0)
        self.momentum_vector = None

    def aggregate_fit(self, server_round, results):
        fedavg_result = aggregate(results)
        if self.server_opt:
            initial_weights = self.initial_parameters
            pseudo_gradient = [x - y for x, y in zip(self.initial_parameters, fedavg_result)]
            if self.server_momentum > 0.0:
                if server_round > 1:
                    assert self.momentum_vector, "Momentum should have been created on round 1."
                    self.momentum_vector = [
                        self.server_momentum * x + y for x, y in zip(self.momentum_vector, pseudo_gradient)
                    ]
                else:
                    self.momentum_vector = pseudo_gradient
                pseudo_gradient = self.momentum_vector
            fedavg_result = [x - self.server_learning_rate * y for x, y in zip(initial_weights, pseudo_gradient)]
            self.initial_parameters = fedavg_result
        return fedavg_result


class FedOpt:
    """fedopt.py: current_weights from initial_parameters, m_t = v_t = None until the first aggregation."""

    def __init__(self, initial_parameters, eta=1e-1, eta_l=1e-1, beta_1=0.0, beta_2=0.0, tau=1e-9):
        self.current_weights = [np.array(a) for a in initial_parameters]
        self.eta, self.eta_l, self.tau = eta, eta_l, tau
        self.beta_1, self.beta_2 = beta_1, beta_2
        self.m_t = None
        self.v_t = None

    def first_moment(self, delta_t):
        if not self.m_t:
            self.m_t = [np.zeros_like(x) for x in delta_t]
        self.m_t = [np.multiply(self.beta_1, x) + (1 - self.beta_1) * y for x, y in zip(self.m_t, delta_t)]

    def delta(self, results):
        fedavg_weights_aggregate = aggregate(results)  # FedAvg.aggregate_fit (super), weighted by num_examples
        return [x - y for x, y in zip(fedavg_weights_aggregate, self.current_weights)]


class FedAdam(FedOpt):
    """fedadam.py: eta=1e-1, beta_1=0.9, beta_2=0.99, tau=1e-9 by default."""

    def __init__(self, initial_parameters, eta=1e-1, eta_l=1e-1, beta_1=0.9, beta_2=0.99, tau=1e-9):
        super().__init__(initial_parameters, eta, eta_l, beta_1, beta_2, tau)

    def aggregate_fit(self, server_round, results):
        delta_t = self.delta(results)
        self.first_moment(delta_t)
        if not self.v_t:
            self.v_t = [np.zeros_like(x) for x in delta_t]
        self.v_t = [self.beta_2 * x + (1 - self.beta_2) * np.multiply(y, y) for x, y in zip(self.v_t, delta_t)]
        eta_norm = (
            self.eta
            * np.sqrt(1 - np.power(self.beta_2, server_round + 1.0))
            / (1 - np.power(self.beta_1, server_round + 1.0))
        )
        new_weights = [
            x + eta_norm * y / (np.sqrt(z) + self.tau) for x, y, z in zip(self.current_weights, self.m_t, self.v_t)
        ]
        self.current_weights = new_weights
        return self.current_weights


class FedYogi(FedOpt):
    """fedyogi.py: eta=1e-2, beta_1=0.9, beta_2=0.99, tau=1e-3 by default."""

    def __init__(self, initial_parameters, eta=1e-2, eta_l=0.0316, beta_1=0.9, beta_2=0.99, tau=1e-3):
        super().__init__(initial_parameters, eta, eta_l, beta_1, beta_2, tau)

    def aggregate_fit(self, server_round, results):
        delta_t = self.delta(results)
        self.first_moment(delta_t)
        if not self.v_t:
            self.v_t = [np.zeros_like(x) for x in delta_t]
        self.v_t = [
            x - (1.0 - self.beta_2) * np.multiply(y, y) * np.sign(x - np.multiply(y, y))
            for x, y in zip(self.v_t, delta_t)
        ]
        new_weights = [
            x + self.eta * y / (np.sqrt(z) + self.tau) for x, y, z in zip(self.current_weights, self.m_t, self.v_t)
        ]
        self.current_weights = new_weights
        return self.current_weights


class FedAdagrad(FedOpt):
    """fedadagrad.py: eta=1e-1, tau=1e-9; beta_1 = beta_2 = 0.0 passed to FedOpt (not settable)."""

    def __init__(self, initial_parameters, eta=1e-1, eta_l=1e-1, tau=1e-9):
        super().__init__(initial_parameters, eta, eta_l, beta_1=0.0, beta_2=0.0, tau=tau)

    def aggregate_fit(self, server_round, results):
        delta_t = self.delta(results)
        self.first_moment(delta_t)
        if not self.v_t:
            self.v_t = [np.zeros_like(x) for x in delta_t]
        self.v_t = [x + np.multiply(y, y) for x, y in zip(self.v_t, delta_t)]
        new_weights = [
            x + self.eta * y / (np.sqrt(z) + self.tau) for x, y, z in zip(self.current_weights, self.m_t, self.v_t)
        ]
        self.current_weights = new_weights
        return self.current_weights


STRATEGIES = {"fedavgm": FedAvgM, "fedadam": FedAdam, "fedyogi": FedYogi, "fedadagrad": FedAdagrad}


# -- broken on purpose: each must fail the comparison --------------------------------------------------------------
class MomentumNeverKept(FedAvgM):
    """FedAvgM whose momentum vector is rebuilt from zero every round."""

    def aggregate_fit(self, server_round, results):
        self.momentum_vector = None
        return super().aggregate_fit(1, results)


class AdamWithoutBiasCorrection(FedAdam):
    """FedAdam stepping with eta instead of eta_norm."""

    def aggregate_fit(self, server_round, results):
        eta = self.eta
        self.eta = eta / (np.sqrt(1 - self.beta_2 ** (server_round + 1.0)) / (1 - self.beta_1 ** (server_round + 1.0)))
        try:
            return super().aggregate_fit(server_round, results)
        finally:
            self.eta = eta


class YogiWithBeta1(FedYogi):
    """FedYogi decaying v with (1 − beta_1) for (1 − beta_2)."""

    def aggregate_fit(self, server_round, results):
        beta_2 = self.beta_2
        self.beta_2 = self.beta_1
        try:
            return super().aggregate_fit(server_round, results)
        finally:
            self.beta_2 = beta_2


class AdagradUnweighted(FedAdagrad):
    """FedAdagrad averaging the clients uniformly instead of by num_examples."""

    def delta(self, results):
        return super().delta([(w, 1) for w, _ in results])


BROKEN = {
    "fedavgm": MomentumNeverKept,
    "fedadam": AdamWithoutBiasCorrection,
    "fedyogi": YogiWithBeta1,
    "fedadagrad": AdagradUnweighted,
}
