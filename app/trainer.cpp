#include "app/trainer.h"

#include "parallel/device_communicator.h"
#include "parallel/mpi_communicator.h"
#include "parallel/mpi_session.h"
#include "parallel/self_communicator.h"

namespace fp8moe {

TrainComms::TrainComms(const ProcessGrid& grid, Backend& be, bool nccl, int ranks_per_node) {
  auto host = [&](MPI_Comm comm, const char* name) {
    owned_.push_back(std::make_unique<MpiCommunicator>(comm, name));
    return owned_.back().get();
  };
  Communicator *world = host(grid.world(), "world"), *pp = host(grid.pipeline(), "pp"), *dp = host(grid.data(), "dp"),
               *tp = host(grid.tensor(), "tp"), *ep = host(grid.expert(), "ep"), *edp = host(grid.expert_data(), "edp");
  // The same groups on the backend's memory, in this order on every rank (NCCL's set-up is
  // collective over each group).
  auto on_device = [&](Communicator* h, MPI_Comm comm, const char* name) {
    if (be.host_accessible()) return h;
    owned_.push_back(make_device_communicator(comm, be, nccl, name));
    return owned_.back().get();
  };
  Communicator *tp_d = on_device(tp, grid.tensor(), "tp"), *ep_d = on_device(ep, grid.expert(), "ep"),
               *dp_d = on_device(dp, grid.data(), "dp"), *edp_d = on_device(edp, grid.expert_data(), "edp"),
               *pp_d = on_device(pp, grid.pipeline(), "pp");
  groups_ = {{tp_d, tp}, {ep_d, ep}, {dp_d, dp}, {edp_d, edp}, {pp_d, pp}, world};
  const std::vector<int64_t> mine(size_t(ep->size()), node_index(grid.world(), ranks_per_node));
  expert_nodes_.resize(mine.size());
  ep->alltoall(mine.data(), expert_nodes_.data(), 1);  // block j of the result: rank j's node
}

TrainComms::TrainComms(Backend& be) {
  owned_.push_back(std::make_unique<SelfCommunicator>(be));
  Communicator* self = owned_.back().get();
  groups_ = {{self, self}, {self, self}, {self, self}, {self, self}, {self, self}, self};
  expert_nodes_ = {0};
}

ModelGroups TrainComms::model() const {
  const TrainGroups& g = groups_;
  return ModelGroups{.pipeline = g.pipeline.device, .tensor = g.tensor.device, .data = g.data.device,
                     .expert = g.expert.device, .expert_counts = g.expert.host, .expert_data = g.expert_data.device};
}

RunnerGroups TrainComms::runner() const {
  return {groups_.pipeline.device, groups_.pipeline.host, groups_.data.host, groups_.world};
}

Trainer::Trainer(const Config& cfg, Backend& be, const TrainComms& comms, std::string layout)
    : model(be, cfg, comms.model()),
      sync(model.store(), *comms.groups().data.device, *comms.groups().expert_data.device,
           model.placement().at().tensor_rank, cfg.optim.zero == 1, cfg.optim.grad_reduce,
           cfg.optim.overlap_grad_reduce, model.tied_copies()),
      opt(be, sync.local_table(), cfg.train, sync.owned()),
      scaler(cfg.train),
      state{&cfg, &model, &opt, &scaler, &progress, std::move(layout), sync.write_rows(), sync.moment_write_rows()} {
  if (ExpertDispatcher* d = model.dispatcher()) {
    d->set_nodes(comms.expert_nodes(), cfg.runtime.node_dedup);
    d->set_overlap(cfg.runtime.overlap_expert_comm);
  }
}

}  // namespace fp8moe
