// SwitchML-compatible client API, part of netagg: jobs. See context.h.

#ifndef NETAGG_SWITCHML_JOB_H
#define NETAGG_SWITCHML_JOB_H

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include "common.h"

namespace switchml {

enum JobType { ALLREDUCE, BROADCAST };
enum AllReduceOperation { SUM };
union ExtraJobInfo {
  AllReduceOperation allreduce_operation;
  std::int32_t broadcast_root_rank;
};
/// QUEUED..FAILED have the values of netagg_job_state.
enum JobStatus { INIT = 0, QUEUED = 1, RUNNING = 2, FINISHED = 3, FAILED = 4 };

/// An allreduce submitted through Context. Unlike SwitchML's, a job that could not be
/// submitted (the context not running, a bad argument) exists too: it is FAILED from the
/// start, and GetErrorMessage() says why.
class Job {
 public:
  /// Waits until the job has finished or failed; GetJobStatus() tells which.
  void WaitToComplete() {
    if (job_.handle() == 0) {
      return;
    }
    try {
      job_.wait();
      Settle(FINISHED, std::string());
    } catch (const netagg::Error& error) {
      Settle(FAILED, error.what());
    }
  }

  JobStatus GetJobStatus() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (status_ == FINISHED || status_ == FAILED || job_.handle() == 0) {
        return status_;
      }
    }
    try {
      netagg_job_state state = job_.state();
      if (state == NETAGG_JOB_STATE_FAILED) {
        WaitToComplete();  // ended already: collects the error message
      } else if (state == NETAGG_JOB_STATE_FINISHED) {
        Settle(FINISHED, std::string());
      } else {
        return static_cast<JobStatus>(state);
      }
    } catch (const netagg::Error& error) {
      Settle(FAILED, error.what());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    return status_;
  }

  /// netagg's addition: why the job failed ("" unless it did).
  std::string GetErrorMessage() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

  /// The job's number: from 1 in submission order, the same on every rank; 0 for a job
  /// that was never submitted.
  const JobId id_;
  const Tensor tensor_;
  const JobType job_type_;
  const ExtraJobInfo extra_job_info_;

  /// A job the library runs (Context makes these).
  Job(netagg::Job job, JobId id, Tensor tensor, AllReduceOperation operation)
      : id_(id), tensor_(tensor), job_type_(ALLREDUCE), extra_job_info_(Extra(operation)),
        job_(std::move(job)), status_(QUEUED) {}

  /// A job that ended before the library ran it.
  Job(Tensor tensor, AllReduceOperation operation, JobStatus status, std::string error)
      : id_(0), tensor_(tensor), job_type_(ALLREDUCE), extra_job_info_(Extra(operation)),
        status_(status), error_(std::move(error)) {}

 private:
  static ExtraJobInfo Extra(AllReduceOperation operation) {
    ExtraJobInfo extra;
    extra.allreduce_operation = operation;
    return extra;
  }

  void Settle(JobStatus status, const std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    status_ = status;
    error_ = error;
  }

  netagg::Job job_;
  std::mutex mutex_;
  JobStatus status_;
  std::string error_;
};

}  // namespace switchml

#endif  // NETAGG_SWITCHML_JOB_H
