"""Every exception the control plane raises on purpose, in one tree (the model is httpx's
_exceptions.py). control/api/errors.py maps each to the gRPC status an admin or a shim sees:

    ControlPlaneError
    ├── ConfigError           a config file, a saved fleet or an admin's backend spec is
    │                         invalid (INVALID_ARGUMENT; at start, control exits saying why)
    ├── FactsError            a backend's engine does not tell the facts a pair needs
    ├── RegistryError         the registry refuses a change
    │   ├── BackendExists     add: the id is taken (ALREADY_EXISTS)
    │   ├── BackendNotFound   no backend has the id (NOT_FOUND)
    │   ├── PairRefused       a pairing breaks an invariant; the message starts with its name
    │   │                     (FAILED_PRECONDITION)
    │   ├── PairNotFound      no pair has the id (NOT_FOUND)
    │   ├── PairExists        the draft is paired already (ALREADY_EXISTS)
    │   ├── TenantExists      add: the tenant id is taken (ALREADY_EXISTS)
    │   ├── TenantNotFound    no tenant (or no key of the tenant) has the id (NOT_FOUND)
    │   └── PriceNotFound     unset: the model has no price (NOT_FOUND)
    └── StoreError            a replica's write to its store (etcd) was not made
        ├── StoreUnavailable  etcd did not answer (UNAVAILABLE)
        ├── NotLeader         this replica does not lead (FAILED_PRECONDITION)
        └── StoreConflict     another writer changed the configuration first (ABORTED)

ConfigError and FactsError are also ValueErrors: both say that a value read from outside
is wrong. The shared core's TokenError (baton/tokens.py) is a credential file's."""

# baton: pure

from __future__ import annotations


class ControlPlaneError(Exception):
    pass


class ConfigError(ControlPlaneError, ValueError):
    pass


class FactsError(ControlPlaneError, ValueError):
    """The backend's answer does not carry the facts (or no backend answered)."""


class RegistryError(ControlPlaneError):
    pass


class BackendExists(RegistryError):
    pass


class BackendNotFound(RegistryError):
    pass


class PairRefused(RegistryError):
    """A pairing breaks an invariant; the message starts with the invariant's name."""


class PairNotFound(RegistryError):
    pass


class PairExists(RegistryError):
    pass


class TenantExists(RegistryError):
    pass


class TenantNotFound(RegistryError):
    pass


class AdapterNotFound(RegistryError):
    pass


class PriceNotFound(RegistryError):
    pass


class AdapterRefused(RegistryError):
    """An adapter operation the fleet cannot do (the backend serves no adapters of its base)."""


class StoreError(ControlPlaneError):
    """A control replica's write to etcd was not made (and its change was undone)."""


class StoreUnavailable(StoreError):
    pass


class NotLeader(StoreError):
    pass


class StoreConflict(StoreError):
    pass
