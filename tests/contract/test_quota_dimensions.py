"""Adding a dimension to the quota is one field in QuotaSpec (and a migration): no other place lists them.

A copy of kembed_contract whose QuotaSpec has one more field, `licences` (one per node of a running job), is put
in front of the real one in a fresh interpreter; the real API then has to admit, refuse, count, export and show
that dimension with nothing else changed. A place that restated the dimensions (admission's arithmetic, a usage
query, the metrics, the dashboard's serialisation, the Tenant resource) would miss it and fail here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import kembed_contract

REPO = Path(__file__).resolve().parents[2]
ANCHOR = '    @field_validator("*")\n'
NEW_FIELD = '''\
    licences: Annotated[Annotated[int, Field(ge=0, le=10_000)] | None, Dimension(
        Stored.COUNT, unit="licences", label="Licences", used="licences", metric="licences",
        held=Held(lambda r: r.nodes),
    )] = Field(None, description="Solver licences, one per node of a running job.")

'''

CHECKS = textwrap.dedent('''
    import json
    from pathlib import Path

    import kembed_contract.quota
    assert Path(kembed_contract.quota.__file__).is_relative_to(Path(TMP)), "the copy is the one imported"

    import kembed_api.auth.models, kembed_api.auth.session_models  # noqa: F401 - every table registered
    from prometheus_client import generate_latest
    from kembed_api.quota import admission
    from kembed_api.quota import preemption
    from kembed_api.quota.admission import Demand, Quota
    from kembed_api.dashboard import pages, service as dashboard
    from kembed_api.platform.db import Base, Database
    from kembed_api.quota.demand import demand_columns
    from kembed_api.jobs.models import Job
    from kembed_api.scheduling.observability import Metrics
    from kembed_api.tenants import service as tenants
    from kembed_api.tenants.models import Tenant
    from kembed_contract import crds
    from kembed_contract.quota import QuotaSpec, UsageAmounts
    from kembed_contract.spec import JobSpec
    from tests.builders import make_spec

    # The model, its columns (a migration would add them; here the models' schema is made directly).
    assert "licences" in UsageAmounts.model_fields
    assert "quota_licences" in Tenant.__table__.columns and "licences" in Job.__table__.columns

    # Admission's arithmetic and refusals.
    spec = JobSpec.model_validate(make_spec("solver").with_nodes(3).build())
    demand = Demand.of(spec)
    assert demand.licences == 3 and (demand + demand).licences == 6
    quota = Quota.of(QuotaSpec(licences=4).amounts())
    assert admission.shortfall(quota, used=Demand(licences=2), demand=demand) == (
        "quota.licences: needs 3 licences, 2 of 4 free")
    assert "quota.licences" in admission.never_fits(Quota.of(QuotaSpec(licences=2).amounts()), demand)
    def plan(borrowing_limit):  # "a" holds 2 of its 4 and asks for 3 more; "b", in its cohort, leaves 10 idle
        return preemption.decide(
            shares={"a": preemption.Share(nominal=quota, cohort="c", borrowing_limit=Quota(licences=borrowing_limit)),
                    "b": preemption.Share(nominal=Quota(licences=10), cohort="c")},
            capacity=Quota(), running=[preemption.Running(1, "a", Demand(licences=2, running_jobs=1), 0)],
            queue=[preemption.Pending(2, "a", demand, 0)])
    assert plan(1).admit == [preemption.Admit(2, borrowed=True)]
    assert plan(0).wait[0].reason == "borrowing limit: quota.licences: needs 3 licences, 2 of 4 free"

    # What a tenant holds: usage, the Tenant resource's status, the metrics, the dashboard.
    db = Database(f"sqlite:///{TMP}/kembed.db")
    Base.metadata.create_all(db.engine)
    with db.session(write=True) as session:
        team = tenants.create_tenant(session, name="team", quota=QuotaSpec(licences=4))
        session.flush()
        session.add(Job(id="solver-1", tenant_id=team.id, name="solver", spec=spec.model_dump(mode="json"),
                        state="RUNNING", reason="Started", **demand_columns(demand)))
        session.commit()
        usage = tenants.usage(session, tenant=team)
        assert usage.used.licences == 3 and usage.quota.licences == 4, usage
        status = tenants.usage_status(session, tenant=team).model_dump(by_alias=True)
        assert status["used"]["licences"] == 3, status
        overview = dashboard.overview(session, tenant=team, forecast=dict)
        assert overview.quota_amounts["licences"] == 4
        cluster = dashboard.cluster(session, capacity=Quota(licences=10))
        assert (cluster.used.licences, cluster.sum_of_quotas.licences, cluster.capacity.licences) == (3, 4, 10)
    metrics = generate_latest(Metrics(db).registry).decode()
    assert 'kembed_quota_used{resource="licences",tenant="team"} 3.0' in metrics, metrics
    assert 'kembed_quota_limit{resource="licences",tenant="team"} 4.0' in metrics, metrics
    served = {d["field"]: d for d in json.loads(pages.QUOTA_DIMENSIONS)}
    assert served["licences"] == {"field": "licences", "amount": "licences", "label": "Licences",
                                  "unit": "licences", "kind": "count", "used": "licences", "held": True}

    # The Tenant resource's schema: its quota, and the usage the API writes into its status.
    tenant_crd = next(c for c in crds.render_crds() if c["spec"]["names"]["kind"] == "Tenant")
    schema = tenant_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    assert "licences" in schema["spec"]["properties"]["quota"]["properties"]
    assert "licences" in schema["status"]["properties"]["usage"]["properties"]["used"]["properties"]
    print("licences flowed through")
''')


def test_a_dimension_added_to_a_copy_of_quotaspec_flows_through_admission_usage_metrics_and_the_dashboard(
        tmp_path):
    source = Path(kembed_contract.__file__).parent
    copy = tmp_path / "contract" / "kembed_contract"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    quota = (copy / "quota.py").read_text()
    assert quota.count(ANCHOR) == 1, "the test inserts its field before QuotaSpec's validator"
    (copy / "quota.py").write_text(quota.replace(ANCHOR, NEW_FIELD + ANCHOR))

    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy.parent), str(REPO)])}
    checks = f"TMP = {str(tmp_path)!r}\n{CHECKS}"
    done = subprocess.run([sys.executable, "-c", checks], cwd=REPO, env=environment, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "licences flowed through" in done.stdout
